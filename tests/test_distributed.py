"""Several processes, one run, on this machine: each `gdnx train` process
with its own CPU devices, collectives over gloo, the coordinator on
127.0.0.1. Against one process with all the devices: the same loss at every
step and the same final parameters (1e-6 relative: the two reduce the data
axis in another order, so they differ in the last float32 bits); against an
uninterrupted run with the same processes: bit for bit. Every process a test
starts is bounded in time and stopped at the end."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flax import nnx

from gdnx.loading import load
from gdnx.distributed import PEER_LOST_STATUS, PREEMPTED_STATUS, StopSignals, process_group

# mesh data=2 x fsdp=2 x tensor=2 on 8 devices however they are split into processes
RUN = ["model.hidden_size=32", "model.intermediate_size=32", "data.seq_len=40", "data.num_pairs=4",
       "data.num_keys=16", "data.num_values=16", "model.vocab_size=32", "train.batch_size=8", "train.warmup_steps=2",
       "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=100", "train.target_accuracy=null",
       "parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"]
STEPS = 8
LIMIT_S = 300  # a run of a few steps takes well under a minute; a hang fails the test instead of CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run:
    """`gdnx train` as `processes` processes of `8 / processes` CPU devices each."""

    def __init__(self, out: Path, processes: int, extra: list[str] = (), *, steps: int = STEPS,
                 heartbeat_s: int | None = None):
        devices = 8 // processes
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
        port = _free_port()
        self.out, self.logs, self.procs = out, [], []
        out.parent.mkdir(parents=True, exist_ok=True)
        for i in range(processes):
            args = [sys.executable, "-m", "gdnx", "train", "tiny", *RUN, *extra, f"train.steps={steps}",
                    f"train.out_dir={out}"]
            if processes > 1:
                args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                         "--process-id", str(i)]
                if heartbeat_s is not None:
                    args += ["--heartbeat-timeout", str(heartbeat_s)]
            log = out.parent / f"{out.name}.{i}.log"
            self.logs.append(log)
            with log.open("ab") as f:
                self.procs.append(subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env))

    def wait(self, timeout: float = LIMIT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def output(self, i: int = 0) -> str:
        return self.logs[i].read_text(errors="replace")

    def wait_for_step(self, step: int, timeout: float = LIMIT_S) -> None:
        """Until the metrics log has a line of `step` (or later)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a process ended early:\n{self.output()[-2000:]}")
            if _losses(self.out) and max(_losses(self.out)) >= step:
                return
            time.sleep(0.05)
        raise AssertionError(f"step {step} not reached in {timeout} s:\n{self.output()[-2000:]}")


@contextlib.contextmanager
def _running(*runs: _Run):
    try:
        yield runs
    finally:
        for run in runs:
            run.kill()


def _losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _params(out: Path):
    """The latest checkpoint's step and parameters, loaded as `gdnx
    generate` loads them: onto this process's one device, whatever mesh
    wrote them."""
    found = load(out, [], "generate")
    model, loaded = found.model, found.description
    return int(loaded.split()[1]), nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _assert_same(a: Path, b: Path, *, exact: bool) -> None:
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    pa, pb = _params(a), _params(b)
    assert pa[0] == pb[0] == STEPS
    flat_a, flat_b = (dict(_leaves(p[1])) for p in (pa, pb))
    assert flat_a.keys() == flat_b.keys()
    if exact:
        assert la == lb
        for k in flat_a:
            np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=k)
    else:
        np.testing.assert_allclose([la[s] for s in sorted(la)], [lb[s] for s in sorted(lb)], rtol=1e-6)
        for k in flat_a:
            np.testing.assert_allclose(flat_a[k], flat_b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, np.asarray(tree)


def test_the_process_group_comes_from_options_then_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert process_group(None, None, None, env=env) == process_group("10.0.0.1:1234", 4, 3, env={})
    assert process_group("127.0.0.1:9", 2, 1, env=env).num_processes == 2  # options win
    assert process_group(None, None, None, env={}).coordinator is None  # left to cluster detection
    for args, field in [(("nohost", 2, 0), "--coordinator"), (("h:1", 0, 0), "--num-processes"),
                        (("h:1", 2, 2), "--process-id"), (("h:1", 2, -1), "--process-id")]:
        with pytest.raises(ValueError, match=field):
            process_group(*args, env={})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        process_group(None, None, None, env={"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="--heartbeat-timeout"):
        process_group("h:1", 2, 0, 0, env={})


def test_a_signal_that_lands_while_the_processes_share_theirs_stops_the_next_step(monkeypatch):
    """SIGTERM handled in the middle of the per-step all-gather (the place a
    process waits for the others) is not lost: the gather saw none, the next
    one carries it."""
    from jax.experimental import multihost_utils

    import gdnx.distributed as distributed

    signals = StopSignals()

    def gather_while_a_signal_lands(x):
        signals._handle(signal.SIGTERM, None)
        return np.stack([np.asarray(x), np.zeros_like(x)])  # this process's value and a peer's

    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(multihost_utils, "process_allgather", gather_while_a_signal_lands)
    assert not signals.reached()
    assert signals.reached() and signals.signal == signal.SIGTERM


def test_two_processes_match_one_then_sigterm_to_one_stops_both_and_another_process_count_resumes(tmp_path):
    """On a text corpus (process 0 prepares it while process 1 waits; each
    reads its rows): 2 x 4 devices against 1 x 8, uninterrupted; then a
    2 x 4 run where process 1 alone gets SIGTERM: both stop at the step they
    agree on with a checkpoint and exit status 75, and the run is resumed by
    2 processes (bit for bit the uninterrupted 2 x 4 run) and by 1 (8 devices
    in one process: orbax restores the shards onto any split of the mesh)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "some words " * (i % 7 + 1)}) + "\n"
                              for i in range(200)))
    text = ["data.source=text", f"data.path={corpus}", "model.vocab_size=256"]
    with _running(_Run(tmp_path / "one", 1, text), _Run(tmp_path / "two", 2, text)) as (one, two):
        assert one.wait() == [0], one.output()
        assert two.wait() == [0, 0], two.output()
    assert (tmp_path / "two" / "data" / "meta.json").is_file()
    _assert_same(tmp_path / "one", tmp_path / "two", exact=False)

    # a checkpoint every step (free to change on resume) keeps the run from ending between two polls
    with _running(_Run(tmp_path / "stopped", 2, [*text, "train.checkpoint_every=1"])) as (stopped,):
        _sigterm_at_step(stopped, 2, to=[1])
        assert stopped.wait() == [PREEMPTED_STATUS] * 2, stopped.output()
    reached = max(_losses(tmp_path / "stopped"))
    assert 2 <= reached < STEPS and _params(tmp_path / "stopped")[0] == reached
    assert all(f"stopped by SIGTERM at step {reached} of {STEPS}" in stopped.output(i) for i in (0, 1))
    shutil.copytree(tmp_path / "stopped", tmp_path / "on_one")
    # one after another: gloo gives a peer 30 s to reach a collective, and
    # several processes compiling at once on a 2-core machine can take longer
    for name, processes in (("stopped", 2), ("on_one", 1)):
        with _running(_Run(tmp_path / name, processes, text)) as (run,):
            assert set(run.wait()) == {0}, run.output()
            assert f"resumed from the checkpoint at step {reached}" in run.output(0)
    _assert_same(tmp_path / "two", tmp_path / "stopped", exact=True)
    _assert_same(tmp_path / "two", tmp_path / "on_one", exact=False)


def test_a_killed_process_ends_the_others_in_one_line_and_the_run_resumes(tmp_path):
    """kill -9 of process 1: process 0 exits within the heartbeat timeout
    with one line and status 4; the run then resumes from its checkpoint."""
    with _running(_Run(tmp_path / "run", 2, ["train.checkpoint_every=2"], heartbeat_s=5)) as (run,):
        run.wait_for_step(3)
        run.procs[1].kill()
        start = time.monotonic()
        status = run.procs[0].wait(timeout=60)
        took = time.monotonic() - start
    assert status == PEER_LOST_STATUS, run.output(0)
    assert took < 30  # the heartbeat timeout (5 s) and the runtime's polling, not a hang
    lines = [line for line in run.output(0).splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("gdnx train: error: another process of the run stopped")
    assert "Traceback" not in run.output(0) and "Check failure" not in run.output(0)
    assert "[Gloo]" not in run.output(0)
    with _running(_Run(tmp_path / "run", 1, ["train.checkpoint_every=2"])) as (resumed,):
        assert resumed.wait() == [0], resumed.output()
    assert "resumed from the checkpoint at step" in resumed.output(0)
    assert sorted(_losses(tmp_path / "run")) == list(range(1, STEPS + 1))

    # generate runs under the distributed runtime too: the same tokens, shown once
    gen = [sys.executable, "-m", "gdnx", "generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "1 2 3 4",
           "--max-new-tokens", "4"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    alone = subprocess.run(gen, capture_output=True, text=True, env=env, timeout=LIMIT_S)
    assert alone.returncode == 0 and len(alone.stdout.split()) == 4, alone.stderr
    port = _free_port()
    procs = [subprocess.Popen(gen + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                     str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=LIMIT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == alone.stdout and outs[1][0] == ""


def test_a_silent_process_ends_the_others_after_the_heartbeat_timeout(tmp_path):
    """A process that stops answering with its connections open (SIGSTOP:
    as when its host vanishes) is taken for dead after --heartbeat-timeout
    seconds: the other exits with one line and status 4, not a hang."""
    with _running(_Run(tmp_path / "run", 2, heartbeat_s=5)) as (run,):
        run.wait_for_step(1)
        worker = _child_of(run.procs[1].pid)
        os.kill(worker, signal.SIGSTOP)
        try:
            start = time.monotonic()
            status = run.procs[0].wait(timeout=120)
            took = time.monotonic() - start
        finally:
            os.kill(worker, signal.SIGKILL)
    assert status == PEER_LOST_STATUS, run.output(0)
    assert 3 < took < 60, took  # the 5 s timeout and the runtime's polling, not an instant error nor a hang
    lines = [line for line in run.output(0).splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("gdnx train: error: another process of the run stopped"), lines
    assert "Check failure" not in run.output(0) and "Traceback" not in run.output(0)


def _sigterm_at_step(run: _Run, step: int, to: list[int]) -> None:
    """SIGTERM to processes `to` of `run` once it has logged `step`, while
    every worker is stopped (SIGSTOP): compiled steps take milliseconds, so
    a signal sent to a running run may land after its last step. The
    supervisors forward SIGTERM to their stopped workers, which take it
    once continued, so the run stops at the end of the step it was in or
    the next."""
    run.wait_for_step(step)
    workers = [_child_of(p.pid) for p in run.procs]
    for worker in workers:
        os.kill(worker, signal.SIGSTOP)
    try:
        for i in to:
            run.procs[i].send_signal(signal.SIGTERM)
        time.sleep(1.0)  # for the supervisors to forward it
    finally:
        for worker in workers:
            os.kill(worker, signal.SIGCONT)


def _child_of(pid: int) -> int:
    """The worker a `gdnx train --distributed` supervisor started."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


_SHARDED_HF = """
import sys
from gdnx.distributed import ProcessGroup, initialize
initialize(ProcessGroup(sys.argv[1], 2, int(sys.argv[2])))
import jax
from gdnx.config.schema import ParallelConfig
from gdnx.models import CausalLM
from gdnx.parallel import make_mesh
model = CausalLM.from_pretrained(sys.argv[3], mesh=make_mesh(ParallelConfig(data=1, fsdp=4, tensor=2)))
kernel = model.layers[0].mixer.in_proj_qkvz.kernel[...]
assert not kernel.is_fully_addressable  # each process holds its devices' parts only
model.save_pretrained(sys.argv[4])
print("saved by", jax.process_index())
"""


def test_two_processes_load_a_hugging_face_directory_sharded_and_save_the_same_bytes(tmp_path):
    """Each process reads its devices' parts of the files (fsdp=4 x tensor=2
    over two processes of 4 devices); saving gathers each tensor and
    process 0 writes: the bytes of a single-process save."""
    from tests.hf_models import random_hf_model

    random_hf_model("qwen3_5_moe").save_pretrained(tmp_path / "hf")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _SHARDED_HF, f"127.0.0.1:{port}", str(i), str(tmp_path / "hf"),
                               str(tmp_path / "two")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=LIMIT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    from gdnx.models import CausalLM

    CausalLM.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "one")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


@pytest.mark.parametrize("error,raised,says", [
    ("DEADLINE_EXCEEDED: Barrier timed out. Id: gdnx:prepare", "BarrierTimeout", "within 5 s"),
    ("UNAVAILABLE: Connection reset by peer", "PeerLost", "while waiting for every process"),
])
def test_a_barrier_timeout_is_a_timeout_not_a_lost_process(monkeypatch, error, raised, says):
    """The distributed runtime's barrier fails: a timeout says so (not
    "another process stopped"), a lost connection is a lost process."""
    from jax._src import distributed as state

    import gdnx.distributed as dist

    class Client:
        def wait_at_barrier(self, name, timeout_in_ms):
            raise RuntimeError(error)

    monkeypatch.setattr(dist, "is_distributed", lambda: True)
    monkeypatch.setattr(state.global_state, "client", Client())
    with pytest.raises(getattr(dist, raised), match=says):
        dist.wait_for_first("prepare", 5)
