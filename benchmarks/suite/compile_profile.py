"""Where a test run's time goes in JAX: per test file, the programs
compiled and the seconds spent tracing, lowering and compiling them.

As a pytest plugin (each xdist worker writes its own file):

    GDNX_COMPILE_PROFILE=/tmp/profile python -m pytest -p benchmarks.suite.compile_profile tests/models

then the files merged into one table, the costliest files first:

    python -m benchmarks.suite.compile_profile /tmp/profile

JAX reports each program's trace, lowering and backend compile through
jax.monitoring; a program is counted against the test file running when
it was built (a session fixture's programs against the first file that
asked for it). Programs read back from the persistent cache count as
compiled by JAX's event (their retrieval is counted apart).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

ENV = "GDNX_COMPILE_PROFILE"
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}
SMALL_S = 0.05  # a backend compile under this is an eager op's or a helper's, counted apart


class _Profile:
    def __init__(self) -> None:
        self.current = "(outside tests)"
        self.files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def listen(self, event: str, duration: float, **_) -> None:
        name = EVENTS.get(event)
        if name is None:
            return
        row = self.files[self.current]
        row[name] += duration
        if name == "compile_s":
            row["programs"] += 1
            if duration < SMALL_S:
                row["small_programs"] += 1
                row["small_compile_s"] += duration


_profile = _Profile()


def pytest_configure(config) -> None:
    if not os.environ.get(ENV):
        raise SystemExit(f"{ENV}: expected a directory for the profile's files")
    import jax

    jax.monitoring.register_event_duration_secs_listener(_profile.listen)


def pytest_runtest_logstart(nodeid, location) -> None:
    _profile.current = nodeid.split("::")[0]


def pytest_sessionfinish(session) -> None:
    out = Path(os.environ[ENV])
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.{os.getpid()}.json").write_text(json.dumps({k: dict(v) for k, v in _profile.files.items()}))


def merge(directory: Path) -> dict[str, collections.Counter]:
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in sorted(directory.glob("*.json")):
        for name, row in json.loads(path.read_text()).items():
            files[name].update(row)
    if not files:
        raise SystemExit(f"{directory}: no profile files (*.json) in it")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help=f"where the plugin wrote its files (${ENV})")
    parser.add_argument("--top", type=int, default=25, help="files shown, costliest first (default 25)")
    args = parser.parse_args()
    files = merge(args.directory)
    cost = lambda r: r["trace_s"] + r["lower_s"] + r["compile_s"]  # noqa: E731
    total: collections.Counter = sum(files.values(), collections.Counter())
    print(f"{'file':<52}{'programs':>9}{'small':>7}{'trace s':>9}{'lower s':>9}{'compile s':>10}{'small s':>9}")
    for name, r in sorted(files.items(), key=lambda kv: -cost(kv[1]))[:args.top] + [("total", total)]:
        print(f"{name[-52:]:<52}{r['programs']:>9.0f}{r['small_programs']:>7.0f}{r['trace_s']:>9.1f}"
              f"{r['lower_s']:>9.1f}{r['compile_s']:>10.1f}{r['small_compile_s']:>9.1f}")


if __name__ == "__main__":
    main()
