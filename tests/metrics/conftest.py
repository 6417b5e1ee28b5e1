"""Fixtures shared by the tests in tests/metrics/ (the suite-wide ones are in tests/conftest.py)."""
