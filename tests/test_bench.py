"""`gdnx bench --quick` runs every row (op implementations, both train steps)."""

import pytest

from gdnx.cli import main


@pytest.mark.slow
def test_bench_quick_runs_every_row(capsys):
    assert main(["bench", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "chunk_gated_delta_rule" in out and "GDN hybrid (3:1)" in out and "attention only" in out
    assert "xla" in out
