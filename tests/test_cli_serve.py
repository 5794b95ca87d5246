"""`gdnx serve`'s refusals before it serves: one line, status 2 (the
server itself: tests/serving/test_server.py)."""

import socket

import pytest

from tests.helpers.cli import refused


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints):
    return hf_checkpoints.path("qwen3_5", tokenizer="chat")


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        err = refused(capsys, ["serve", "--checkpoint", str(tmp_path / "none"), "--port", str(port)])
    assert f"--port: cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.parametrize("flags,match", [
    (["--max-slots", "0"], "--max-slots: expected a positive integer"),
    (["--max-queue", "-1"], "--max-queue: expected a non-negative integer"),
    (["--grace", "-5"], "--grace: expected a non-negative integer"),
    (["--port", "70000"], "--port: expected 0 (any free port) to 65535"),
    (["--max-length", "100000"], "--max-length: 100000 exceeds the model's"),
    (["--speculative", "-1"], "--speculative: expected K (n-gram drafts, 0: off), ngram:K, mtp or mtp:K, got '-1'"),
    (["--speculative", "mtp"], "--speculative: mtp drafts with the model's multi-token prediction module, and this "
                               "model has none"),
    (["--max-prefill-batch", "9"], "--max-prefill-batch: expected an integer in [1, --max-slots=8]"),
    (["model.hidden_size=8"], "model.hidden_size: serve takes overrides of the model.gdn_* fields"),
])
def test_each_bad_flag_is_one_line(checkpoint, capsys, flags, match):
    err = refused(capsys, ["serve", "--checkpoint", str(checkpoint), "--port", "0", *flags])
    assert match in err, err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    err = refused(capsys, ["serve", "--checkpoint", str(tmp_path / "none"), "--port", "0"])
    assert "--checkpoint: no such directory" in err


@pytest.mark.slow
def test_two_servers_started_together_on_one_port_one_serves_and_one_refuses(checkpoint, processes):
    """The second to listen is refused in one line before it loads a model
    (it listens before it announces); the winner serves, here with the
    smallest context (--max-length 2: its warm-up fits it)."""
    import re
    import subprocess
    import time

    import httpx

    from tests.helpers.processes import free_port, gdnx

    port = free_port()
    cmd = gdnx("serve", "--checkpoint", str(checkpoint), "--port", str(port), "--max-length", "2")
    procs = [processes.start(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    loser = None
    deadline = time.monotonic() + 60
    while loser is None:
        loser = next((p for p in procs if p.poll() is not None), None)
        assert time.monotonic() < deadline, "neither server was refused"
        time.sleep(0.1)
    err = loser.stderr.read()
    assert loser.returncode == 2 and err.strip().splitlines() == [
        f"gdnx serve: error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)"], err
    winner = procs[1 - procs.index(loser)]
    lines = []
    for line in winner.stderr:
        lines.append(line)
        if re.search(r"serving .* at http://", line):
            break
    assert winner.poll() is None, "".join(lines)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    winner.send_signal(__import__("signal").SIGTERM)
    assert winner.wait(60) == 0
    assert "Traceback" not in "".join(lines) + winner.stderr.read()


def _start(processes, checkpoint, env, *flags):
    import subprocess

    from tests.helpers.processes import gdnx

    return processes.start(gdnx("serve", "--checkpoint", str(checkpoint), "--port", "0", "--max-slots", "2",
                                "--max-length", "64", "--warm-up", "decode", *flags), stderr=subprocess.PIPE,
                           text=True, errors="replace", env=env)


def _read_until(proc, text: str) -> list[str]:
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError("".join(seen))


@pytest.mark.parametrize("signum,status", [("SIGTERM", 0), ("SIGINT", 130)])
def test_a_stop_while_starting_ends_it_in_one_line(checkpoint, processes, signum, status):
    """SIGTERM (status 0) or Ctrl-C (130) while the server loads and
    compiles: one line, no traceback (SIGTERM killed it by the signal)."""
    import signal

    from tests.helpers.processes import cpu_env

    proc = _start(processes, checkpoint, cpu_env())
    _read_until(proc, "compiling")
    proc.send_signal(getattr(signal, signum))
    rest = proc.stderr.read()
    assert processes.wait(proc, 120) == status, rest
    assert f"gdnx serve: {signum} received while starting; stopped" in rest and "Traceback" not in rest, rest


@pytest.mark.slow
def test_a_second_start_reads_its_programs_from_the_compile_cache(checkpoint, processes, tmp_path):
    """--compile-cache (default ~/.cache/gdnx/compiled; here a directory of
    the test's): the first start writes every program it compiles there; a
    second start of the same server compiles none anew (the cache holds no
    more entries after it); another engine setting compiles its own."""
    import os
    import signal

    from tests.helpers.processes import cpu_env

    env = {k: v for k, v in cpu_env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cache = tmp_path / "compiled"
    counts = []
    for flags in ([], [], ["--decode-steps", "4"]):
        proc = _start(processes, checkpoint, env, "--compile-cache", str(cache), *flags)
        _read_until(proc, "serving")
        counts.append(sum(len(files) for _, _, files in os.walk(cache)))
        proc.send_signal(signal.SIGTERM)
        proc.stderr.read()
        assert processes.wait(proc, 120) == 0
    assert counts[0] > 0 and counts[1] == counts[0] and counts[2] > counts[1], counts
