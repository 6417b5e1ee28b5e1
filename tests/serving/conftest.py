"""Fixtures shared by the tests in tests/serving/ (the suite-wide ones are in tests/conftest.py)."""
