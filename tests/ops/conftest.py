"""x64 for the tests that compare against float64 references (the oracle,
loops in numpy): such a module sets `pytestmark = pytest.mark.usefixtures("x64")`.
Everything else runs with JAX's default (32-bit) types, as a model does."""

import jax
import pytest


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield
