"""Fixtures shared by the tests in tests/core/ (the suite-wide ones are in tests/conftest.py)."""
