"""Test-wide settings: none. x64 is scoped to the tests that need float64
(tests/ops/conftest.py)."""

import pytest

from tests.helpers.processes import Processes


@pytest.fixture
def processes():
    """The test's subprocesses (tests.helpers.processes), stopped when it ends."""
    with Processes() as procs:
        yield procs
