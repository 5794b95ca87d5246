"""What several commands share: the batched engine's options (generate,
serve), --quantize (generate, serve, eval, plan), the several-process
options and starting the distributed runtime."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gdnx.config.reading import ConfigError
from gdnx.serving.config import EngineConfig

if TYPE_CHECKING:
    from gdnx.distributed import ProcessGroup


def quantize_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--quantize", choices=("int8", "int4", "fp8"), default=None,
                         help="hold the projections and routed experts quantized, a float32 factor per block of "
                              "model.quantize_block (128 x 128; for int4 set a smaller one, e.g. "
                              "model.quantize_block=[1,128]; an FP8 checkpoint keeps its blocks with fp8); "
                              "default: as the checkpoint stores them (an FP8 checkpoint dequantized)")


def overrides(args: argparse.Namespace) -> list[str]:
    """The command's key=value overrides, with --quantize as model.quantize."""
    extra = [f"model.quantize={args.quantize}"] if getattr(args, "quantize", None) else []
    return [*args.overrides, *extra]


def engine_options(group: argparse._ActionsContainer, max_length_default: str, prefix_cache_mb: int) -> None:
    """The batched engine's settings (generate --prompts-file, serve), with EngineConfig's defaults."""
    default = EngineConfig()
    group.add_argument("--max-slots", type=int, default=default.max_slots,
                       help=f"requests decoded together (default {default.max_slots})")
    group.add_argument("--max-length", type=int, default=None,
                       help=f"prompt + generated tokens per request (default: {max_length_default})")
    group.add_argument("--prefix-cache-mb", type=int, default=prefix_cache_mb,
                       help=f"host memory for the prefix cache of shared prompt blocks (default {prefix_cache_mb}"
                            + ("; 0: off)" if prefix_cache_mb else ": off)"))
    group.add_argument("--speculative", default=str(default.draft_tokens), metavar="K|mtp[:K]",
                       help="speculative decoding: K n-gram (prompt lookup) draft tokens, or mtp: the model's "
                            "multi-token prediction module drafts (mtp:K chains its first layer for K drafts; "
                            "default 0: off)")
    group.add_argument("--draft-rows", type=int, default=default.draft_rows, metavar="N",
                       help="verify drafts while at most N slots decode; past that, decode plainly (default: 1 on CPU, "
                            "where a verify pass over more rows costs more than its drafts gain; every slot elsewhere)")
    group.add_argument("--batch-invariant", action="store_true",
                       help="each result bit-identical whatever else is batched with it (prefills block by block)")
    group.add_argument("--max-prefill-batch", type=int, default=None, metavar="N",
                       help="prompts prefilled together, at most (default: --max-slots, at most 8); fewer bound the prefill's "
                            "memory (gdnx plan --serve measures it)")


def distributed_options(command: argparse.ArgumentParser) -> None:
    group = command.add_argument_group("several processes (docs/sharding.md)")
    group.add_argument("--distributed", action="store_true",
                       help="one of several processes of a run: start JAX's distributed runtime first (run the same "
                            "command in every process); the options below, else JAX_COORDINATOR_ADDRESS, "
                            "JAX_NUM_PROCESSES, JAX_PROCESS_ID, else the cluster (Cloud TPU, SLURM, Open MPI) say "
                            "where. Any of the options below implies it")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None, help="process 0's address")
    group.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0 .. N-1")
    group.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                       help="a process silent this long is taken for dead and the others stop (default 100)")
    group.add_argument("--join-timeout", type=int, default=None, metavar="SECONDS",
                       help="how long the processes may take to join the run before it stops (default 300)")


def wants_distributed(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "distributed", False)) or any(
        getattr(args, k, None) is not None for k in ("coordinator", "num_processes", "process_id",
                                                     "heartbeat_timeout", "join_timeout"))


def process_group(args: argparse.Namespace) -> ProcessGroup:
    from gdnx.distributed import HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S
    from gdnx.distributed import process_group as group

    try:
        return group(args.coordinator, args.num_processes, args.process_id,
                             HEARTBEAT_TIMEOUT_S if args.heartbeat_timeout is None else args.heartbeat_timeout,
                             JOIN_TIMEOUT_S if args.join_timeout is None else args.join_timeout)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def start_distributed(args: argparse.Namespace) -> None:
    from gdnx.distributed import initialize, native_output_to_supervisor

    group = process_group(args)
    native_output_to_supervisor()
    try:
        initialize(group, args.command)
    except ValueError as e:
        raise ConfigError(str(e)) from None
