"""XLA:CPU compile time of test programs under the XLA flags `make test`
could set: the seconds XLA spends compiling (JAX's compile log, summed over
every program a test compiles) for a few representative tests, each in a
fresh process with an empty compilation cache, per flag set.

    python benchmarks/compile_flags.py [--repeats 2]

Tests: a scanned and an unrolled MoE hybrid's value_and_grad (the model
tests), the op's hand-written VJP against autodiff (the op tests), a train
step with the GDN kernel on and off (the training tests). Prints markdown
for docs/benchmarks.md: median seconds per flag set and the ratio to the
first row.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = {
    "model: scanned = unrolled (MoE)": "tests/models/test_causal_lm.py::"
                                      "test_scanned_layers_equal_the_unrolled_stack[qwen3_next_moe]",
    "op: hand-written VJP": "tests/ops/gated_delta_rule/test_numerics.py::test_hand_written_vjp_matches_autodiff",
    "train step, kernel on/off": "tests/training/test_loop.py::test_train_step_with_kernel_on_and_off",
}
BASE = "--xla_backend_optimization_level=0"
FLAG_SETS = {
    "optimisation level 0": BASE,
    "+ elemental emitters": f"{BASE} --xla_cpu_use_fusion_emitters=false",
    "+ one codegen module": f"{BASE} --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1",
}
_COMPILED = re.compile(r"Finished XLA compilation of \S+ in ([0-9.e-]+) sec")


def compile_seconds(test: str, flags: str) -> float:
    """XLA's compile seconds for everything `test` compiles, cache empty."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_LOG_COMPILES": "1", "JAX_COMPILATION_CACHE_DIR": cache,
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:logging", "-q",
                               "-s", test], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{test} failed under XLA_FLAGS={flags!r}:\n{done.stdout[-2000:]}")
    return sum(float(s) for s in _COMPILED.findall(done.stdout + done.stderr))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per test and flag set (median)")
    args = parser.parse_args()
    seconds = {(name, label): statistics.median(compile_seconds(test, flags) for _ in range(args.repeats))
               for label, flags in FLAG_SETS.items() for name, test in TESTS.items()}
    first = next(iter(FLAG_SETS))
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"`python benchmarks/compile_flags.py --repeats {args.repeats}`\n")
    print("| XLA flags | " + " | ".join(TESTS) + " |")
    print("|---|" + "---:|" * len(TESTS))
    for label in FLAG_SETS:
        cells = [f"{seconds[name, label]:.1f} s ({seconds[name, label] / seconds[name, first]:.2f}x)"
                 for name in TESTS]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
