"""Fixtures shared by the tests in tests/project/ (the suite-wide ones are in tests/conftest.py)."""
