"""Helpers the tests share: imported from here, never out of a conftest file."""
