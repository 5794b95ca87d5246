"""`gdnx bench`: op timings and the train step's time and memory, GDN hybrid against attention."""

from __future__ import annotations

from gdnx.config.reading import ConfigError


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="op timings and train-step time/memory, GDN hybrid vs attention")
    bench.add_argument("--batch", type=int, default=4, help="train-step batch (default 4)")
    bench.add_argument("--seq-len", type=int, default=1024, help="train-step sequence length (default 1024)")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs per row, the median reported (default 5)")
    bench.add_argument("--quick", action="store_true",
                       help="small shapes and 2 repeats: a check that everything runs, in seconds")
    bench.set_defaults(run=run)


def run(args) -> None:
    from gdnx.bench import run_benchmarks

    for flag in ("batch", "seq_len", "repeats"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a positive integer")
    if args.quick:
        run_benchmarks(batch=1, seq_len=128, repeats=2, op_tokens=128, op_head_dim=32, width=64)
    else:
        run_benchmarks(batch=args.batch, seq_len=args.seq_len, repeats=args.repeats)
