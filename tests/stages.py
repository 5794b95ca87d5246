"""The test stages of `make test` (the fast tier) and `make test-all`
(every test), their times, and a stamp file that records them.

    python tests/stages.py fast|all [--stamp FILE]

A tier is a marker expression (pyproject's markers): `fast` leaves out the
tests marked slow or multiprocess, `all` runs every test. Each stage is a
pytest process of its own, for what a process fixes:

- op tests: tests/ops on two xdist workers, without torch (with torch
  loaded in the same process, XLA's CPU compiler segfaulted compiling an
  op test's autodiff scan);
- mesh tests: tests/parallel on 8 virtual CPU devices (XLA reads that
  flag once per process; the directory's conftest.py sets it);
- the rest, on two xdist workers (most of a test is a compile, which is
  single-threaded);
- deviceless: compiles for TPU and GPU targets in .venv-aot (libtpu and
  the CUDA plugin). libtpu admits one process at a time, so the TPU
  targets run in one process; beside it, on the other core, the type
  checker (fast) or the GPU targets and then the op numerics (all; their
  own process: XLA's CPU compiler once segfaulted on a numerics test late
  in a process shared with the interpreted kernels' tests).

Stages of one group run side by side and the group's time is its wall
time; every stage runs even when one fails, and the exit status is 1 when
any failed (pytest's 5, no test collected, is a failure too, said
plainly).

The CPU stages share compiled programs through JAX's persistent
compilation cache (many tests compile the same tiny model's step) and
compile with XLA's CPU backend at optimisation level 0, its elemental
emitters rather than the fusion emitters, each program's code generated as
one module (together they halve the compile time of a model's train step);
none of these changes float semantics.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
AOT_PYTHON = ROOT / ".venv-aot" / "bin" / "python"
NUMERICS = "tests/ops/gated_delta_rule/test_numerics.py"
GPU_TARGETS = "h100 or h200 or a100"
TIERS = {"fast": "not slow and not multiprocess", "all": None}


def cpu_env() -> dict[str, str]:
    return {"JAX_COMPILATION_CACHE_DIR": str(ROOT / ".jax-cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                         "--xla_cpu_parallel_codegen_split_count=1"}


AOT_ENV = {"JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "localhost"}


@dataclass
class Stage:
    name: str
    argv: list[str]
    env: dict[str, str]


def _marks(tier: str, *more: str) -> list[str]:
    parts = [p for p in (TIERS[tier], *more) if p]
    return ["-m", " and ".join(f"({p})" for p in parts)] if parts else []


def pytest(python: Path, tier: str, *args: str, marks: tuple[str, ...] = (), workers: int | None = 2) -> list[str]:
    return [str(python), "-m", "pytest", "-p", "no:cacheprovider", "--durations=15", "--durations-min=1",
            *(["-n", str(workers)] if workers else []), *args, *_marks(tier, *marks)]


def groups(tier: str) -> list[list[Stage]]:
    """The stages of a tier, in groups that run side by side."""
    cpu = cpu_env()
    mypy = Stage("mypy", [str(PYTHON), "-m", "mypy"], {})
    ops = Stage("op tests", pytest(PYTHON, tier, "tests/ops", f"--ignore={NUMERICS}", marks=("not deviceless",)), cpu)
    mesh = Stage("mesh tests", pytest(PYTHON, tier, "--dist", "loadgroup", "tests/parallel"), cpu)
    rest = Stage("the rest", pytest(PYTHON, tier, "--dist", "loadgroup", "tests", "--ignore=tests/ops",
                                    "--ignore=tests/parallel", marks=("not deviceless",)), cpu)
    deviceless = ["tests/ops", "tests/test_train_plan.py", "tests/serving/test_plan.py"]
    tpu = Stage("deviceless TPU", pytest(AOT_PYTHON, tier, *deviceless, "-k", f"not ({GPU_TARGETS})",
                                         marks=("deviceless",), workers=None), AOT_ENV)
    if tier == "fast":
        return [[tpu, mypy], [ops], [mesh], [rest]]
    gpu = Stage("deviceless GPU", pytest(AOT_PYTHON, tier, *deviceless, "-k", GPU_TARGETS, marks=("deviceless",),
                                         workers=None), AOT_ENV)
    numerics = Stage("op numerics", pytest(PYTHON, tier, NUMERICS, workers=1), cpu)
    return [[mypy], [ops], [mesh], [rest], [tpu, gpu, numerics]]


def _run_group(group: list[Stage], logs: Path) -> list[tuple[Stage, int, float]]:
    """The first stage streams its output; the others' logs print after it.
    Stages after the first run one after another beside it."""
    first, beside = group[0], group[1:]
    logs.mkdir(exist_ok=True)
    t0 = time.monotonic()
    script = "; ".join(f"( t=$(date +%s); {_quoted(s)} > {logs / _slug(s)}.log 2>&1; "
                       f"echo $? $(( $(date +%s) - t )) > {logs / _slug(s)}.rc )" for s in beside)
    side = subprocess.Popen(["sh", "-c", script]) if beside else None
    rc = subprocess.call(first.argv, cwd=ROOT, env={**os.environ, **first.env})
    results = [(first, rc, time.monotonic() - t0)]
    if side is not None:
        side.wait()
        for s in beside:
            print(f"--- {s.name}:", flush=True)
            print((logs / f"{_slug(s)}.log").read_text(), flush=True)
            code, seconds = (logs / f"{_slug(s)}.rc").read_text().split()
            results.append((s, int(code), float(seconds)))
    return results


def _slug(stage: Stage) -> str:
    return stage.name.replace(" ", "-")


def _quoted(stage: Stage) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in stage.env.items())
    return f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.join(stage.argv)}"


def _tree() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    changed = len([line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line])
    return f"tree {git('rev-parse', 'HEAD^{tree}')[:12]} (HEAD {git('rev-parse', '--short', 'HEAD')}" + (
        f", {changed} tracked files changed)" if changed else ", clean)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tier", choices=sorted(TIERS))
    parser.add_argument("--stamp", type=Path, help="write the tier's stamp here (tree, date, each stage's time)")
    args = parser.parse_args()
    command = "make test" if args.tier == "fast" else "make test-all"
    start, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    lines = [f"{command}: {_tree()}, started {start:%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores"]
    failed = False
    for group in groups(args.tier):
        for stage, rc, seconds in _run_group(group, ROOT / ".test-logs"):
            status = "passed" if rc == 0 else "FAILED (pytest collected no tests)" if rc == 5 else f"FAILED ({rc})"
            failed |= rc != 0
            lines.append(f"{command}: {stage.name}: {status} in {seconds:.0f} s")
            print(lines[-1], flush=True)
    lines.append(f"{command}: {'FAILED' if failed else 'passed'} in {time.monotonic() - t0:.0f} s")
    print("\n".join(lines), flush=True)
    if args.stamp:
        args.stamp.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
