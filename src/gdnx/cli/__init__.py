"""The `gdnx` command: train, generate, serve, eval, export, prepare, plan,
bench, one module each in this package, each registering its parser
(`add_parser`) and the function that runs it.

User errors (a bad config key or value, a missing, unreadable or corrupt
file, a checkpoint of another config, an option this machine cannot run, a
full disk, running out of memory) print one line and exit with status 2,
without a traceback; docs/errors.md lists them. A run stopped by the
non-finite guard exits with status 3; one whose other process died, 4; one
stopped by SIGTERM or SIGINT after saving a checkpoint, 75. Anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from gdnx import __version__
from gdnx.cli import bench, eval, export, generate, plan, prepare, serve, train
from gdnx.cli.options import process_group, start_distributed, wants_distributed
from gdnx.config.reading import ConfigError

# OSErrors that come from the machine or the user's files, not from gdnx
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                errno.ENOTDIR, errno.EISDIR, errno.EEXIST}
MEMORY_HINT = ("raise train.grad_accum_steps, reduce data.seq_len, set model.remat_policy=full, or shard over more "
               "devices (parallel.fsdp)")
# the engine's caches and host arrays are sized by its flags
SERVING_MEMORY_HINT = "lower --max-slots or --max-length (they size the engine's caches), or shard over more devices"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdnx", description="Gated DeltaNet for JAX")
    parser.add_argument("--version", action="version", version=f"gdnx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, generate, serve, eval, export, prepare, plan, bench):
        command.add_parser(sub)
    return parser


def _dispatch(args) -> int:
    if wants_distributed(args):
        start_distributed(args)
    return args.run(args) or 0


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)


def _refused() -> int:
    """Status 2 for a mistake already said in one line; in a run of several
    processes, at once (gdnx.distributed.exit_said)."""
    from gdnx.distributed import exit_said, started

    if started():
        exit_said(2)
    return 2


def main(argv: list[str] | None = None) -> int:
    from gdnx.checkpoints.orbax import CheckpointDamaged
    from gdnx.distributed import (PREEMPTED_STATUS, SUPERVISED, BarrierTimeout, exit_peer_lost, exit_run,
                                  peer_failure, supervise)
    from gdnx.files import DirectoryBusy
    from gdnx.training import NonFiniteStop, Preempted

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (gdnx plan X --topology T key=value)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    say = lambda text: print(f"gdnx {args.command}: {text}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        if wants_distributed(args) and SUPERVISED not in os.environ:
            process_group(args)  # a bad option is refused before any process starts
            return supervise(argv, args.command)  # the work runs in a child: see gdnx.distributed
        return _dispatch(args)
    except (ConfigError, FileNotFoundError, CheckpointDamaged, DirectoryBusy) as e:
        say(f"error: {e}")
        return _refused()
    except NonFiniteStop as e:
        say(str(e))
        return 3
    except BarrierTimeout as e:
        exit_run(args.command, str(e))
    except Preempted as e:
        say(str(e))
        return PREEMPTED_STATUS
    except OSError as e:
        if e.errno not in _USER_ERRNOS:
            raise
        hint = {errno.ENOSPC: "free space or point train.out_dir elsewhere", errno.EDQUOT: "free space or point "
                "train.out_dir elsewhere", errno.EFBIG: "raise the file size limit (ulimit -f)"}.get(e.errno)
        say(f"error: {f'{e.filename}: ' if e.filename else ''}{e.strerror}"
            + (f"; {hint}; the run resumes from its last checkpoint" if hint else ""))
        return _refused()
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Exception as e:
        if (lost := peer_failure(e)) is not None:
            exit_peer_lost(args.command, lost)
        if not _out_of_memory(e):
            raise
        hint = MEMORY_HINT
        if args.command == "generate":
            from gdnx.inference import MEMORY_HINT as hint
        elif args.command == "serve" or getattr(args, "serve", False):
            hint = SERVING_MEMORY_HINT
        say(f"error: out of memory ({str(e).splitlines()[0][:160]}); {hint}")
        return _refused()


if __name__ == "__main__":
    sys.exit(main())
