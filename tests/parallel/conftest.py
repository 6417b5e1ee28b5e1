"""Fixtures shared by the tests in tests/parallel/ (the suite-wide ones are in tests/conftest.py)."""
