"""Fixtures shared by the tests in tests/model/ (the suite-wide ones are in tests/conftest.py)."""
