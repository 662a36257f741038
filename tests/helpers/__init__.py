"""Helpers shared by tests in several folders (imported as ``helpers.<module>``; see tests/conftest.py)."""
