"""The `gdnx` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gdnx", description="Gated DeltaNet for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the op against its float64 oracle and time it")
    demo.add_argument("--length", type=int, default=512, help="tokens per sequence (default 512)")
    demo.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64, 128))
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.length < 1:
            parser.error("--length: expected a positive number of tokens")
        from gdnx import demo as demo_mod

        demo_mod.run(t=args.length, chunk=args.chunk_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
