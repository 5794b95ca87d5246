"""The `gdnx` command: train, generate, bench.

User errors (a bad config key or value, a missing file, a checkpoint of
another config, an option this machine cannot run) print one line and exit
with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from gdnx.config.loading import DEFAULT_CONFIG, ConfigError, bundled_names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdnx", description="Gated DeltaNet for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: the tiny model on MQAR)",
                           description="Train, or resume the run in train.out_dir from its latest checkpoint.")
    train.add_argument("config", nargs="?", default=None,
                       help=f"a YAML file or a bundled config ({', '.join(bundled_names())}); "
                            f"default {DEFAULT_CONFIG}. A key=value here is taken as an override.")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.steps=100 parallel.tensor=4")
    train.add_argument("--distributed", action="store_true",
                       help="multi-host: call jax.distributed.initialize() first (run the same command on every "
                            "host; docs/sharding.md)")
    gen = sub.add_parser("generate", help="generate from a gdnx checkpoint or a Hugging Face directory")
    gen.add_argument("--checkpoint", required=True, help="a gdnx train.out_dir or a Hugging Face directory (Qwen3-Next, Qwen3.5, OLMo Hybrid)")
    gen.add_argument("--prompt", required=True, help="text (token ids separated by spaces for MQAR models)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("overrides", nargs="*", metavar="key=value",
                     help="model config overrides, e.g. model.gdn_implementation=xla")
    bench = sub.add_parser("bench", help="op timings and train-step time/memory, GDN hybrid vs attention")
    bench.add_argument("--batch", type=int, default=4)
    bench.add_argument("--seq-len", type=int, default=1024)
    bench.add_argument("--repeats", type=int, default=5)
    return parser


def _run(args) -> int:
    if args.command == "train":
        from gdnx.config import load_config
        from gdnx.train import prepare
        from gdnx.train import run as run_training

        overrides = list(args.overrides)
        if args.distributed:
            import jax

            jax.distributed.initialize()  # coordinator etc. from the cluster's environment
        name = args.config
        if name is not None and "=" in name:
            name, overrides = None, [name] + overrides
        config = load_config(name, overrides)
        try:
            trainer = prepare(config)
        except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
            raise ConfigError(str(e)) from None
        run_training(trainer)
    elif args.command == "generate":
        from gdnx.cli_generate import run_generate

        run_generate(args)
    elif args.command == "bench":
        from gdnx.bench import run

        for flag in ("batch", "seq_len", "repeats"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')}: expected a positive integer")
        run(batch=args.batch, seq_len=args.seq_len, repeats=args.repeats)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"gdnx {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gdnx {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
