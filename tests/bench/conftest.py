"""Fixtures shared by the tests in tests/bench/ (the suite-wide ones are in tests/conftest.py)."""
