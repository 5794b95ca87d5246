"""The test tiers (pyproject's markers): `make test` runs what is marked
neither slow nor multiprocess, `make test-all` everything. A road's
first case stays in `make test`; its sweep over more families, layouts
and lengths is marked slow."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

SLOW = pytest.mark.slow
MULTIPROCESS = pytest.mark.multiprocess


def fast_only(values: Iterable[Any], fast: Callable[[Any], bool], *, one_argument: bool = False) -> list[Any]:
    """Parametrize values with every one that `fast` rejects marked slow. A
    tuple is a case of several arguments, unless `one_argument`."""
    def param(v):
        return pytest.param(*(v if isinstance(v, tuple) and not one_argument else (v,)), marks=SLOW)
    return [v if fast(v) else param(v) for v in values]
