"""x64 for the tests that compare against float64 references (the oracle,
loops in numpy): such a module sets `pytestmark = pytest.mark.usefixtures("x64")`.
Everything else runs with JAX's default (32-bit) types, as a model does.
Contract tests take their cases from the implementation's class
(delta_rule/contract.py: `over`); `make test` runs each one's first case,
`make test-all` every case (the others are marked slow)."""

import jax
import pytest


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def pytest_generate_tests(metafunc):
    attribute = getattr(metafunc.function, "contract_cases", None)
    if attribute is None or metafunc.cls is None:
        return
    values = list(getattr(metafunc.cls, attribute))
    if not values:  # the contract's test does not apply to this implementation
        skip = pytest.mark.skip(reason=f"{metafunc.cls.__name__} has no {attribute}")
        metafunc.parametrize("case", [pytest.param(None, marks=skip)], ids=["none"])
        return
    ids = [str(v) if hasattr(v, "name") else f"{type(v).__name__}{i}" for i, v in enumerate(values)]
    metafunc.parametrize("case", [v if i == 0 else pytest.param(v, marks=pytest.mark.slow)
                                  for i, v in enumerate(values)], ids=ids)
