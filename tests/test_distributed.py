"""Several processes, one run, on this machine: each `gdnx train` process
with its own CPU devices, collectives over gloo, the coordinator on
127.0.0.1. Against one process with all the devices: the same loss at every
step and the same final parameters (1e-6 relative: the two reduce the data
axis in another order, so they differ in the last float32 bits); against an
uninterrupted run with the same processes: bit for bit. Every process a test
starts is bounded in time and stopped at the end."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from flax import nnx

from gdnx.inference import load
from gdnx.distributed import PEER_LOST_STATUS, PREEMPTED_STATUS, StopSignals, process_group
from tests.helpers.processes import LIMIT_S, Processes, cpu_env, free_port, gdnx

# mesh data=2 x fsdp=2 x tensor=2 on 8 devices however they are split into processes
RUN = ["model.hidden_size=32", "model.intermediate_size=32", "data.seq_len=40", "data.num_pairs=4",
       "data.num_keys=16", "data.num_values=16", "model.vocab_size=32", "train.batch_size=8", "train.warmup_steps=2",
       "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=100", "train.target_accuracy=null",
       "parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"]
STEPS = 8


class _Run:
    """`gdnx train` as `processes` processes of `8 / processes` CPU devices each."""

    def __init__(self, procs: Processes, out: Path, processes: int, extra: Sequence[str] = (), *,
                 steps: int = STEPS, heartbeat_s: int | None = None, ids: Sequence[int] | None = None,
                 own: Sequence[Sequence[str]] | None = None, port: int | None = None, flags: Sequence[str] = ()):
        """ids: the process ids to start (default all); own: each started
        process's own extra overrides; flags: more command-line flags."""
        env = cpu_env(devices=8 // processes)
        port = free_port() if port is None else port
        self.out, self.logs, self.procs, self.port = out, [], [], port
        self._registry = procs
        out.parent.mkdir(parents=True, exist_ok=True)
        for n, i in enumerate(range(processes) if ids is None else ids):
            mine = [] if own is None else list(own[n])
            args = gdnx("train", "tiny", *RUN, *extra, *mine, f"train.steps={steps}", f"train.out_dir={out}",
                        *flags)
            if processes > 1:
                args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                         "--process-id", str(i)]
                if heartbeat_s is not None:
                    args += ["--heartbeat-timeout", str(heartbeat_s)]
            log = out.parent / f"{out.name}.{i}.{n}.log"
            self.logs.append(log)
            with log.open("ab") as f:
                self.procs.append(procs.start(args, stdout=f, stderr=subprocess.STDOUT, env=env))

    def wait(self, timeout: float = LIMIT_S) -> list[int]:
        """Every process's status; past `timeout` each still running is killed and the test fails."""
        deadline = time.monotonic() + timeout
        try:
            return [self._registry.wait(p, max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
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


# session scope: built once on the worker that runs the "text_runs" group, whatever other tests of this module
# that worker runs between them (a module fixture would be rebuilt after each)
@pytest.fixture(scope="session")
def text_runs(tmp_path_factory):
    """On a text corpus (process 0 prepares it while process 1 waits; each
    reads its rows): a run of 1 x 8 devices and one of 2 x 4, uninterrupted;
    then a 2 x 4 run in which process 1 alone gets SIGTERM after step 2.
    Returns the directory and each run's statuses; the tests below check
    them, so a failure in one stage does not hide the others."""
    root = tmp_path_factory.mktemp("text_runs")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "some words " * (i % 7 + 1)}) + "\n"
                              for i in range(200)))
    text = ["data.source=text", f"data.path={corpus}", "model.vocab_size=256"]
    runs = {}
    with Processes() as procs:
        one, two = _Run(procs, root / "one", 1, text), _Run(procs, root / "two", 2, text)
        runs["one"], runs["two"] = (one, one.wait()), (two, two.wait())
        # a checkpoint every step (free to change on resume) keeps the run from ending between two polls
        stopped = _Run(procs, root / "stopped", 2, [*text, "train.checkpoint_every=1"])
        try:
            _sigterm_at_step(stopped, 2, to=[1])
        finally:
            runs["stopped"] = (stopped, stopped.wait())
    return root, text, runs


@pytest.mark.multiprocess
@pytest.mark.xdist_group("text_runs")  # one worker builds the runs once
def test_two_processes_match_one_on_a_text_corpus(text_runs):
    root, _, runs = text_runs
    assert runs["one"][1] == [0], runs["one"][0].output()
    assert runs["two"][1] == [0, 0], runs["two"][0].output()
    assert (root / "two" / "data" / "meta.json").is_file()
    _assert_same(root / "one", root / "two", exact=False)


def _stopped_at(text_runs) -> int:
    root, _, runs = text_runs
    stopped, statuses = runs["stopped"]
    assert statuses == [PREEMPTED_STATUS] * 2, stopped.output()
    return max(_losses(root / "stopped"))


@pytest.mark.multiprocess
@pytest.mark.xdist_group("text_runs")  # one worker builds the runs once
def test_sigterm_to_one_process_stops_both_at_a_step_they_agree_on(text_runs):
    root, _, runs = text_runs
    reached = _stopped_at(text_runs)
    assert 2 <= reached < STEPS and _params(root / "stopped")[0] == reached
    assert all(f"stopped by SIGTERM at step {reached} of {STEPS}" in runs["stopped"][0].output(i) for i in (0, 1))


@pytest.mark.multiprocess
@pytest.mark.xdist_group("text_runs")  # one worker builds the runs once
@pytest.mark.parametrize("processes_now", [2, 1])
def test_a_stopped_run_resumes_on_two_processes_bit_for_bit_or_on_one(text_runs, tmp_path, processes, processes_now):
    """2 processes: bit for bit the uninterrupted 2 x 4 run; 1 (8 devices in
    one process: orbax restores the shards onto any split of the mesh):
    within the float32 rounding of another reduction order."""
    root, text, _ = text_runs
    reached = _stopped_at(text_runs)
    shutil.copytree(root / "stopped", tmp_path / "run")
    run = _Run(processes, tmp_path / "run", processes_now, text)
    assert set(run.wait()) == {0}, run.output()
    assert f"resumed from the checkpoint at step {reached}" in run.output(0)
    _assert_same(root / "two", tmp_path / "run", exact=processes_now == 2)


@pytest.mark.multiprocess
def test_a_killed_process_ends_the_others_in_one_line_and_the_run_resumes(tmp_path, processes):
    """kill -9 of process 1: process 0 exits within the heartbeat timeout
    with one line and status 4; the run then resumes from its checkpoint."""
    run = _Run(processes, tmp_path / "run", 2, ["train.checkpoint_every=2"], heartbeat_s=5)
    run.wait_for_step(3)
    run.procs[1].kill()
    start = time.monotonic()
    status = processes.wait(run.procs[0], 60)
    took = time.monotonic() - start
    assert status == PEER_LOST_STATUS, run.output(0)
    assert took < 30  # the heartbeat timeout (5 s) and the runtime's polling, not a hang
    lines = [line for line in run.output(0).splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("gdnx train: error: another process of the run stopped")
    assert "Traceback" not in run.output(0) and "Check failure" not in run.output(0)
    assert "[Gloo]" not in run.output(0)
    resumed = _Run(processes, tmp_path / "run", 1, ["train.checkpoint_every=2"])
    assert resumed.wait() == [0], resumed.output()
    assert "resumed from the checkpoint at step" in resumed.output(0)
    assert sorted(_losses(tmp_path / "run")) == list(range(1, STEPS + 1))

    # generate runs under the distributed runtime too: the same tokens, shown once
    gen = gdnx("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "1 2 3 4", "--max-new-tokens", "4")
    alone = subprocess.run(gen, capture_output=True, text=True, env=cpu_env(), timeout=LIMIT_S)
    assert alone.returncode == 0 and len(alone.stdout.split()) == 4, alone.stderr
    port = free_port()
    procs = [processes.start(gen + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                    str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=LIMIT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == alone.stdout and outs[1][0] == ""


@pytest.mark.multiprocess
def test_a_silent_process_ends_the_others_after_the_heartbeat_timeout(tmp_path, processes):
    """A process that stops answering with its connections open (SIGSTOP:
    as when its host vanishes) is taken for dead after --heartbeat-timeout
    seconds: the other exits with one line and status 4, not a hang."""
    run = _Run(processes, tmp_path / "run", 2, heartbeat_s=5)
    run.wait_for_step(1)
    worker = _child_of(run.procs[1].pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        start = time.monotonic()
        status = processes.wait(run.procs[0], 120)
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


@pytest.mark.multiprocess
def test_two_processes_load_a_hugging_face_directory_sharded_and_save_the_same_bytes(tmp_path, processes):
    """Each process reads its devices' parts of the files (fsdp=4 x tensor=2
    over two processes of 4 devices); saving gathers each tensor and
    process 0 writes: the bytes of a single-process save."""
    from tests.helpers.hf_models import random_hf_model

    random_hf_model("qwen3_5_moe").save_pretrained(tmp_path / "hf")
    port = free_port()
    procs = [processes.start([sys.executable, "-c", _SHARDED_HF, f"127.0.0.1:{port}", str(i), str(tmp_path / "hf"),
                              str(tmp_path / "two")], env=cpu_env(devices=4), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=LIMIT_S)[0] for p in procs]
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


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


@pytest.mark.multiprocess
def test_processes_started_with_different_configs_refuse_naming_the_field(tmp_path, processes):
    """Two processes of one run with different learning rates: both refuse
    in one line naming train.learning_rate, before anything is written."""
    run = _Run(processes, tmp_path / "run", 2, own=[["train.learning_rate=1e-3"], ["train.learning_rate=2e-3"]])
    assert run.wait() == [2, 2], run.output()
    for i in range(2):
        lines = _error_lines(run.output(i))
        assert len(lines) == 1 and ("train.learning_rate: 0.001 in process" in lines[0]
                                    or "train.learning_rate: 0.002 in process" in lines[0]), lines
        assert "Traceback" not in run.output(i)
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.multiprocess
def test_a_coordinator_port_in_use_is_one_line(tmp_path, processes):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        run = _Run(processes, tmp_path / "run", 2, ids=[0], port=taken.getsockname()[1])
        assert run.wait(120) == [2], run.output()
    lines = _error_lines(run.output())
    assert len(lines) == 1 and f"--coordinator: port {run.port} is in use on this host" in lines[0], run.output()


@pytest.mark.multiprocess
def test_a_process_that_never_joins_and_a_second_process_id_are_named(tmp_path, processes):
    """Process 1 never starts: process 0 says every few seconds that it
    waits, then stops after --join-timeout in one line (status 4). Then a
    run of two whose process 1 is started twice: the run stops, naming the
    --process-id given twice."""
    alone = _Run(processes, tmp_path / "alone", 2, ids=[0], flags=["--join-timeout", "11"])
    assert alone.wait(120) == [PEER_LOST_STATUS], alone.output()
    out = alone.output()
    assert out.count("waiting for the 2 processes of the run to join") >= 2, out
    lines = _error_lines(out)
    assert len(lines) == 1 and "not every process joined the run at 127.0.0.1" in lines[0], out
    assert "within --join-timeout (11 s)" in lines[0]
    run = _Run(processes, tmp_path / "twice", 2, steps=200)
    run.wait_for_step(1)
    again = _Run(processes, tmp_path / "twice", 2, ids=[1], port=run.port, steps=200, flags=["--join-timeout", "6"])
    statuses = run.wait(120)
    assert statuses == [PEER_LOST_STATUS] * 2, run.output()
    again.wait(120)
    for i in range(2):
        lines = _error_lines(run.output(i))
        assert len(lines) == 1 and "a second process started with --process-id 1 tried to join" in lines[0], lines
