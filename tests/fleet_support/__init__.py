"""Shared helpers for the fleet's tests and benchmark (tiny guest, test-driver hosts)."""
