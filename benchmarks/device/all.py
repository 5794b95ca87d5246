"""Every accelerator benchmark in one run, into one markdown file: the
ops' checks against the float64 recurrence and their timings at the
published anchors' shape (GDN at Qwen3-Next's heads, KDA at Kimi
Linear's; T = 32,768 and 8,192; xla beside the kernel), then a model's
train step at Qwen3-Next's layer shapes (4,096 tokens; the GDN hybrid with
xla and with the kernel, and attention only, with MFU). A part that fails
says so in its table and the run goes on.

    python -m benchmarks.device.all [--out FILE] [--lengths 32768 8192] [--tokens 4096] [--repeats 5]

On a TPU v5e it takes about 7 minutes with its compiles. The train step
needs gdnx's dependencies on the machine (docs/benchmarks.md gives the
install line for the lent TPU); without them its table says which is
missing.
"""

from __future__ import annotations

import argparse
import traceback

import jax

from benchmarks.device.ops import KERNEL, check_table, timing_table
from benchmarks.harness import Table, write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 8192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    kernel = KERNEL.get(jax.default_backend())
    if kernel is None:
        ap.error(f"the default JAX backend is {jax.default_backend()!r}: this benchmark needs a TPU or a GPU")
    tables = [check_table(op, kernel) for op in ("gdn", "kda")]
    tables += [timing_table(op, 1, t, 512, args.repeats, kernel) for t in args.lengths for op in ("gdn", "kda")]
    try:
        from benchmarks.device.train import train_table
        tables.append(train_table(4, args.tokens, 20, []))
    except ImportError as e:  # gdnx's model needs its dependencies installed on the machine
        traceback.print_exc()
        tables.append(Table(f"A train step at Qwen3-Next's layer shapes: not run ({e})", ["tokens"]))
    write(args.out, *tables)


if __name__ == "__main__":
    main()
