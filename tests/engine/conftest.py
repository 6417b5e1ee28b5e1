"""Fixtures shared by the tests in tests/engine/ (the suite-wide ones are in tests/conftest.py)."""
