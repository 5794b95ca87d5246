"""Test-wide settings: none. x64 is scoped to the tests that need float64
(tests/ops/conftest.py)."""
