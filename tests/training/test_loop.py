"""`gdnx train` end to end on a very small run: metrics, plot, checkpoints,
resume after the process is killed, and the loop's resources closed on
every exit."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gdnx.config import load_config
from gdnx.training import Trainer, build_trainer, train
from tests.helpers.configs import SMALL_RUN
from tests.helpers.processes import Processes, gdnx
from tests.helpers.checkpoints import saved_params
from tests.helpers.tiers import fast_only



def test_train_writes_metrics_plot_and_checkpoints(tmp_path):
    cfg = load_config("tiny", SMALL_RUN + ["train.steps=8", "train.checkpoint_every=4", f"train.out_dir={tmp_path}"])
    result = train(cfg)
    assert result["step"] == 8 and 0.0 <= result["accuracy"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4, 6, 8]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [4, 8]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]


def _cli(procs: Processes, out: Path, steps: int) -> subprocess.Popen:
    args = gdnx("train", "tiny", *SMALL_RUN, f"train.steps={steps}", "train.checkpoint_every=3",
                f"train.out_dir={out}")
    return procs.start(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_the_resume_matches_an_uninterrupted_run(tmp_path, processes):
    """SIGTERM once the step-3 checkpoint is complete (its checksum manifest
    is written last): the run finishes its step, saves a checkpoint there
    and exits with status 75; started again, it resumes from that step and
    its final parameters equal those of a run that was never stopped, with
    each step once in the metrics log. Kills (SIGKILL) at random moments are
    tested below; several processes in tests/test_distributed.py."""
    straight = _cli(processes, tmp_path / "straight", 9)
    stopped = _cli(processes, tmp_path / "stopped", 9)
    ckpt = tmp_path / "stopped" / "checksums" / "3.json"
    deadline = time.time() + 300
    while not ckpt.is_file() and stopped.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.is_file(), stopped.communicate()[0]
    stopped.send_signal(signal.SIGTERM)
    out, _ = stopped.communicate(timeout=300)
    reached = max(int(p.stem) for p in (tmp_path / "stopped" / "checksums").glob("*.json"))
    if reached < 9:  # (the run may have ended first on a fast machine)
        assert stopped.returncode == 75, out
        assert f"stopped by SIGTERM at step {reached} of 9" in out and reached > 3
    resumed = _cli(processes, tmp_path / "stopped", 9)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert reached == 9 or f"resumed from the checkpoint at step {reached}" in out
    assert straight.wait(timeout=600) == 0
    (s1, p1), (s2, p2) = saved_params(tmp_path / "straight"), saved_params(tmp_path / "stopped")
    assert s1 == s2 == 9
    flat1, flat2 = (jax_leaves(p) for p in (p1, p2))
    for a, b in zip(flat1, flat2, strict=True):
        np.testing.assert_array_equal(a, b)
    steps = [json.loads(x)["step"] for x in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 9


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


@pytest.mark.parametrize("implementation", fast_only(["pallas_tpu", "xla"], lambda i: i == "pallas_tpu"))
def test_train_step_with_kernel_on_and_off(tmp_path, implementation):
    cfg = load_config("tiny", SMALL_RUN + ["train.steps=4", f"model.gdn_implementation={implementation}",
                                       "model.num_hidden_layers=1",
                                       "model.layer_types=[linear_attention]", f"train.out_dir={tmp_path}"])
    if implementation == "pallas_tpu":
        with pytest.warns(UserWarning, match="interpret mode"):
            result = train(cfg)
    else:
        result = train(cfg)
    assert result["step"] == 4 and np.isfinite(result["loss"])


def test_a_run_that_reached_its_target_is_not_extended(tmp_path, capsys, monkeypatch):
    overrides = SMALL_RUN + ["train.steps=20", f"train.out_dir={tmp_path}"]
    assert train(load_config("tiny", overrides + ["train.steps=4"]))["step"] == 4
    capsys.readouterr()
    # the evaluation of the restored parameters says the target is met
    monkeypatch.setattr(Trainer, "evaluate", lambda self, params: {"loss": 0.1, "accuracy": 0.995,
                                                                    "first_query_accuracy": 0.99})
    again = train(load_config("tiny", overrides + ["train.target_accuracy=0.99"]))
    assert again["step"] == 4 and "nothing to do" in capsys.readouterr().err
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4]


def _strict_json_lines(path: Path) -> list[dict]:
    def no_constants(name):
        raise ValueError(f"bare {name} in {path}")
    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_non_finite_steps_do_not_update_and_stop_the_run(tmp_path, capsys, monkeypatch):
    """Every loss NaN: no step updates the parameters, the run stops after
    train.nonfinite_steps_limit steps in a row with one line naming the step
    and the last good checkpoint (exit 3); the checkpoint holds the initial
    parameters; metrics.jsonl stays strict JSON."""
    import jax.numpy as jnp

    from gdnx.training import step as train_module
    from gdnx.cli import main

    real = train_module.loss_and_metrics
    monkeypatch.setattr(train_module, "loss_and_metrics",
                        lambda *args: (lambda l, m: (l * jnp.nan, {**m, "loss": m["loss"] * jnp.nan}))(
                            *real(*args)))
    argv = ["train", "tiny", *SMALL_RUN, "train.steps=20", "train.checkpoint_every=3", "train.nonfinite_steps_limit=5",
            f"train.out_dir={tmp_path}"]
    assert main(argv) == 3
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdnx")]
    assert len(lines) == 1 and "stopped at step 5: 5 steps in a row" in lines[0]
    assert f"the last good checkpoint is step 3 in {tmp_path}" in lines[0]
    rows = _strict_json_lines(tmp_path / "metrics.jsonl")
    assert rows and all(r["loss"] is None and r["skipped"] == 1.0 for r in rows if r["split"] == "train")
    step, params = saved_params(tmp_path)
    init = Trainer(load_config("tiny", SMALL_RUN + [f"train.out_dir={tmp_path}"])).params
    assert step == 3
    for a, b in zip(jax_leaves(params), jax_leaves(init), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_run_with_some_non_finite_steps_goes_on(tmp_path, capsys, monkeypatch):
    import jax.numpy as jnp

    from gdnx.training import step as train_module

    real = train_module.loss_and_metrics

    def sometimes_nan(model, batch, *args):  # about one batch in three
        loss, metrics = real(model, batch, *args)
        return loss * jnp.where(jnp.sum(batch.inputs) % 3 == 0, jnp.nan, 1.0), metrics
    monkeypatch.setattr(train_module, "loss_and_metrics", sometimes_nan)
    result = train(load_config("tiny", SMALL_RUN + ["train.steps=12", f"train.out_dir={tmp_path}"]))
    assert result["step"] == 12
    assert "parameters not updated" in capsys.readouterr().err
    assert all(np.isfinite(x).all() for x in jax_leaves(saved_params(tmp_path)[1]))


def _interrupted(procs: Processes, out: Path, steps: int, kills: list[float]) -> subprocess.Popen:
    """Start the run, SIGKILL it `kills` seconds after each (re)start that got
    past its first checkpoint, then let the last start finish."""
    for delay in kills:
        proc = _cli(procs, out, steps)
        deadline = time.time() + 300
        while not (out / "checkpoints").is_dir() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return _cli(procs, out, steps)


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_is_bit_identical(tmp_path, processes):
    """Killed at random moments (checkpoint writes included: one every 3
    steps of a few hundred ms), restarted each time: the final parameters
    equal an uninterrupted run's."""
    straight = _cli(processes, tmp_path / "straight", 12)
    delays = list(np.random.default_rng(7).uniform(0.0, 3.0, 3))
    last = _interrupted(processes, tmp_path / "killed", 12, delays)
    out, _ = last.communicate(timeout=600)
    assert last.returncode == 0, out
    assert straight.wait(timeout=600) == 0
    (s1, p1), (s2, p2) = saved_params(tmp_path / "straight"), saved_params(tmp_path / "killed")
    assert s1 == s2 == 12
    for a, b in zip(jax_leaves(p1), jax_leaves(p2), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_full_disk_stops_cleanly_and_the_run_resumes(tmp_path, processes):
    """A file size limit (ulimit -f) below a checkpoint's size: the run
    stops with one line before writing it (exit 2), nothing damaged is
    left; without the limit it resumes and ends bit-identical to a run
    never stopped."""
    import shlex

    args = [sys.executable, "-m", "gdnx.cli", "train", "tiny", *SMALL_RUN, "train.steps=9", "train.checkpoint_every=3",
            f"train.out_dir={tmp_path / 'run'}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # files up to 200 KiB (ulimit -f counts KiB); an ignored SIGXFSZ makes a larger write fail with EFBIG
    shell = f"trap '' XFSZ; ulimit -f 200; exec {shlex.join(args)}"
    limited = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in limited.stderr.splitlines() if line.startswith("gdnx")]
    assert limited.returncode == 2 and len(lines) == 1 and "File too large" in lines[0], limited.stderr
    assert "Traceback" not in limited.stderr
    assert not any(p.name.isdigit() for p in (tmp_path / "run" / "checkpoints").iterdir())
    _strict_json_lines(tmp_path / "run" / "metrics.jsonl")
    straight = _cli(processes, tmp_path / "straight", 9)
    resumed = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert straight.wait(timeout=600) == 0
    for a, b in zip(jax_leaves(saved_params(tmp_path / "run")[1]), jax_leaves(saved_params(tmp_path / "straight")[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def _peak_rss(argv: list[str]) -> int:
    """Peak resident KiB of `gdnx ARGV` in a fresh process."""
    code = ("import resource, sys; from gdnx.cli import main; rc = main(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("MAXRSS")))


def _text_corpus(directory: Path, megabytes: int) -> None:
    directory.mkdir()
    rng = np.random.default_rng(megabytes)
    words = np.asarray([w.encode() for w in "the delta rule writes keys and values into a state that decays".split()])
    for i in range(megabytes * 10):  # 100 KB documents
        (directory / f"{i:05d}.txt").write_bytes(b" ".join(rng.choice(words, 20_000))[:100_000])


@pytest.mark.slow
def test_a_corpus_ten_times_larger_takes_no_more_memory_and_resumes_bit_identical(tmp_path, processes):
    """10 MB and 100 MB of text, prepared and trained on: peak resident
    memory flat in corpus size (within 64 MiB); a training run on the
    prepared shards killed and resumed ends bit-identical to the measured
    run on them, uninterrupted."""
    def train_argv(data, out):
        return ["train", "tiny", *SMALL_RUN, "data.source=tokens", f"data.path={data}", "model.vocab_size=256",
                "train.steps=9", "train.checkpoint_every=3", f"train.out_dir={out}"]

    peaks = {}
    for mb in (10, 100):
        _text_corpus(tmp_path / f"text{mb}", mb)
        prepare_peak = _peak_rss(["prepare", str(tmp_path / f"text{mb}"), "--out", str(tmp_path / f"tok{mb}")])
        train_peak = _peak_rss(train_argv(tmp_path / f"tok{mb}", tmp_path / f"run{mb}"))
        peaks[mb] = (prepare_peak, train_peak)
    print(f"peak RSS KiB (prepare, train): {peaks}")  # docs/benchmarks.md quotes these
    for stage in (0, 1):
        assert peaks[100][stage] - peaks[10][stage] < 64 * 1024, peaks

    killed_out = tmp_path / "killed"
    args = [sys.executable, "-m", "gdnx.cli", *train_argv(tmp_path / "tok100", killed_out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    killed = processes.start(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = killed_out / "checksums" / "3.json"
    deadline = time.time() + 300
    while not ckpt.is_file() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert subprocess.run(args, env=env, capture_output=True).returncode == 0
    for a, b in zip(jax_leaves(saved_params(tmp_path / "run100")[1]), jax_leaves(saved_params(killed_out)[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_training_with_gradient_accumulation_tracks_the_whole_batch(tmp_path):
    """Three optimizer steps with 4 micro-batches of 2 rows land on the
    parameters of three steps on batches of 8: 1e-5 relative over all
    parameters, 1e-4 per leaf (AdamW divides each gradient entry by the root
    of its second moment, so an entry near zero moves by about the learning
    rate whatever its float32 rounding; measured 1.6e-5 on one leaf)."""
    from gdnx.measure import relative_error

    params = {}
    for n in (1, 4):
        cfg = load_config("tiny", SMALL_RUN + ["train.batch_size=8", f"train.grad_accum_steps={n}", "train.steps=3",
                                           "train.warmup_steps=0", "train.eval_every=0",
                                           f"train.out_dir={tmp_path / str(n)}"])
        train(cfg)
        params[n] = jax_leaves(saved_params(tmp_path / str(n))[1])
    flat = [np.concatenate([np.ravel(x) for x in params[n]]) for n in (4, 1)]
    assert relative_error(*flat) <= 1e-5
    for a, b in zip(params[4], params[1], strict=True):
        assert relative_error(a, b) <= 1e-4


@pytest.mark.slow
def test_bfloat16_activations_track_the_float32_run(tmp_path):
    """Mixed precision (model.dtype=bfloat16, float32 parameters, AdamW
    moments, GDN state and decay): 100 MQAR steps follow the float32 run's
    loss within 1% at every logged step and 0.3% on average (measured 0.16%
    and 0.06%, while the loss falls from 3.40 to 2.86); parameters and optimizer state stay float32."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        train(load_config("tiny", SMALL_RUN + ["train.steps=100", "train.eval_every=0", "train.log_every=5",
                                           f"model.dtype={dtype}", f"train.out_dir={out}"]))
        losses[dtype] = np.array([r["loss"] for r in _strict_json_lines(out / "metrics.jsonl")])
        assert all(x.dtype == np.float32 for x in jax_leaves(saved_params(out)[1]))
    full, mixed = losses["float32"], losses["bfloat16"]
    assert full[-1] < full[0] - 0.3  # it learns: the comparison is not between two flat lines
    gap = np.abs(mixed - full) / full
    assert gap.max() <= 0.01 and gap.mean() <= 0.003, (gap.max(), gap.mean())


def _text_run(tmp_path: Path) -> list[str]:
    """A host-read run (the prefetch thread runs), on a small byte corpus."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(40)))
    return SMALL_RUN + ["data.source=text", f"data.path={corpus}", "model.vocab_size=256", "train.steps=8",
                    "train.checkpoint_every=2", f"train.out_dir={tmp_path / 'run'}"]


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gdnx-prefetch" and t.is_alive()]


@pytest.mark.parametrize("failure", ["save", "interrupt"])
def test_a_failed_save_or_an_interrupt_leaves_no_thread_running(tmp_path, monkeypatch, failure):
    """The loop closes the prefetch thread, the metrics log and the checkpoint
    manager on every exit: here a save that raises (a full disk) and a
    KeyboardInterrupt in the middle of the run."""
    from gdnx.checkpoints.orbax import Checkpoints
    from gdnx.training import loop

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if failure == "save":
        monkeypatch.setattr(Checkpoints, "save", disk_full)
        expected: type[BaseException] = OSError
    else:
        monkeypatch.setattr(loop.Trainer, "evaluate", interrupt)
        expected = KeyboardInterrupt
    closed = []
    real_close = Checkpoints.close
    monkeypatch.setattr(Checkpoints, "close", lambda self: (closed.append(True), real_close(self))[1])
    trainer = build_trainer(load_config("tiny", _text_run(tmp_path)))
    with pytest.raises(expected):
        trainer.run()
    assert trainer._prefetch is None and not _loop_threads()
    assert closed == [True]


def test_a_second_run_on_a_busy_out_dir_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys, processes):
    """Another process holds train.out_dir: `gdnx train` there is one line and
    exit 2, and nothing in the directory changes. A lock whose holder was
    killed (its pid left in the file, its flock gone with it) is taken over,
    with one line."""
    from gdnx.cli import main

    out = tmp_path / "run"
    out.mkdir()
    argv = ["train", "tiny", *SMALL_RUN, "train.steps=4", f"train.out_dir={out}"]
    holder = processes.start([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from gdnx.files import directory_lock\n"
        "with directory_lock(Path(sys.argv[1]), 'train.out_dir'):\n    print('held', flush=True); time.sleep(60)"),
        str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main(argv) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("gdnx")]
        assert lines == [f"gdnx train: error: train.out_dir {out}: in use by another run (pid {holder.pid}); "
                         "wait for it to end or choose another train.out_dir"]
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    assert main(argv) == 0  # killed: its pid stays in the lock file, its flock is gone
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long notes
    assert f"its lock was left by a run that ended without releasing it (pid {holder.pid}); taken over" in err
    assert (out / ".lock").read_text() == ""  # released at the end of the run


@pytest.mark.slow
def test_a_damaged_metrics_log_does_not_block_the_resume(tmp_path, capsys):
    """A full disk can leave metrics.jsonl ending mid-line: the resumed run
    drops that line, says so, and continues the log as strict JSON."""
    over = SMALL_RUN + ["train.checkpoint_every=2", "train.eval_every=0", "train.warmup_steps=1",
                    f"train.out_dir={tmp_path}"]
    train(load_config("tiny", over + ["train.steps=2"]))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "split": "tr')
    capsys.readouterr()
    train(load_config("tiny", over + ["train.steps=4"]))
    assert "dropped 1 damaged line(s)" in " ".join(capsys.readouterr().err.split())
    assert [r["step"] for r in _strict_json_lines(tmp_path / "metrics.jsonl")] == [2, 4]


def test_no_evaluations_and_a_target_accuracy_run_every_step_and_resume(tmp_path, capsys):
    """train.eval_every=0 with a target accuracy (tiny's 0.99): no
    evaluation runs, so the target is not checked (a note says so) and the
    run takes its steps; resuming it on text data (no evaluation source)
    goes on too, where the target's hook once evaluated and failed."""
    over = _text_run(tmp_path) + ["train.eval_every=0", "train.target_accuracy=0.99", "train.warmup_steps=1"]
    assert train(load_config("tiny", over + ["train.steps=2"]))["step"] == 2
    said = capsys.readouterr()
    assert "train.target_accuracy 0.99 is not checked: train.eval_every=0" in said.out + said.err
    assert train(load_config("tiny", over + ["train.steps=4"]))["step"] == 4


def test_wandb_online_without_credentials_is_one_line_before_the_run_writes(tmp_path, capsys, monkeypatch):
    from gdnx.cli import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    out = tmp_path / "run"
    assert main(["train", "tiny", *SMALL_RUN, "train.trackers=[wandb]", "train.wandb.mode=online",
                 f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "train.wandb.mode: online needs W&B credentials" in err and "Traceback" not in err
    assert not out.exists()
