"""The `gdnx` command: train, generate, serve, export, prepare, plan, bench.

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

from typing import TYPE_CHECKING

from gdnx import __version__
from gdnx.config.loading import DEFAULT_CONFIG, ConfigError, bundled_names

if TYPE_CHECKING:
    from gdnx.distributed import ProcessGroup

# OSErrors that come from the machine or the user's files, not from gdnx
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                errno.ENOTDIR, errno.EISDIR, errno.EEXIST}
MEMORY_HINT = ("raise train.grad_accum_steps, reduce data.seq_len, set model.remat_policy=full, or shard over more "
               "devices (parallel.fsdp)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdnx", description="Gated DeltaNet for JAX")
    parser.add_argument("--version", action="version", version=f"gdnx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: the tiny model on MQAR)",
                           description="Train, or resume the run in train.out_dir from its latest intact checkpoint.")
    train.add_argument("config", nargs="?", default=None,
                       help=f"a YAML file or a bundled config ({', '.join(bundled_names())}); "
                            f"default {DEFAULT_CONFIG}. A key=value here is taken as an override.")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.steps=100 parallel.tensor=4")
    _distributed_options(train)
    gen = sub.add_parser("generate", help="generate from a gdnx checkpoint or a Hugging Face directory")
    gen.add_argument("--checkpoint", required=True,
                     help="a gdnx train.out_dir or a Hugging Face directory (Qwen3-Next, Qwen3.5, OLMo Hybrid)")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text (token ids separated by spaces for MQAR models), streamed to the terminal")
    what.add_argument("--prompts-file", help="a jsonl file of {\"prompt\": text, sampling fields optional} run "
                                             "through the batched engine (docs/serving.md); results to --out")
    gen.add_argument("--out", help="with --prompts-file: the jsonl file of results, one per prompt, in order, each "
                                   "written once it and every earlier one are done")
    gen.add_argument("--resume", action="store_true",
                     help="with --prompts-file: keep the results already in --out and run the lines after them")
    gen.add_argument("--max-new-tokens", type=int, default=32,
                     help="tokens to generate (default 32; prompt + new tokens must fit the model's positions)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: all)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0; line i of a prompts file: "
                                                          "seed + i unless it gives its own)")
    _engine_options(gen.add_argument_group("the engine (--prompts-file)"), "the longest line's need", 0)
    gen.add_argument("overrides", nargs="*", metavar="key=value",
                     help="model.gdn_* and model.dtype overrides, e.g. model.gdn_implementation=xla; parallel.* "
                          "places the model on a mesh of this host's devices as gdnx train does, e.g. "
                          "parallel.tensor=4 (the batched engine: context=1)")
    _distributed_options(gen)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat) on the batched engine",
                           description="Serve a gdnx run or a Hugging Face directory over HTTP: /v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /metrics (docs/serving.md).")
    serve.add_argument("--checkpoint", required=True,
                       help="a gdnx train.out_dir (its latest checkpoint) or a Hugging Face directory")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this "
                       "machine only)")
    serve.add_argument("--port", type=int, default=8000, help="default 8000; 0 takes a free port (printed)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name requests give (default: the checkpoint directory's name)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes (or set GDNX_API_KEY)")
    _engine_options(serve, "the model's positions, at most 4096", 1024)
    serve.add_argument("--decode-steps", type=int, default=8,
                       help="tokens per slot per decode round trip (default 8; fewer: smoother streams)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="requests that may wait for a slot; more are answered 503 at once (default 256)")
    serve.add_argument("--grace", type=int, default=30, metavar="SECONDS",
                       help="on SIGTERM, how long requests in flight may take to finish (default 30)")
    serve.add_argument("--max-request-bytes", type=int, default=8 * 2 ** 20, metavar="BYTES",
                       help="a larger request body is answered 413 (default 8 MiB)")
    serve.add_argument("--request-timeout", type=int, default=30, metavar="SECONDS",
                       help="a client's time to send a whole request, and an idle connection's life (default 30)")
    serve.add_argument("--warm-up", choices=("all", "decode"), default="all",
                       help="before listening, compile every program a request can need (all, the default: each "
                            "prefill shape too; docs/serving.md counts them) or only the decode steps (decode: a "
                            "quicker start, the first request of each new shape waits for the compiler)")
    serve.add_argument("--tool-call-parser", choices=("hermes", "kimi_k2", "olmo3"), default=None,
                       help="parse tool calls from chat outputs in the format of the checkpoint's template (hermes: "
                            "<tool_call>{...}</tool_call>, Qwen3-Next's and Qwen3.5's; kimi_k2: "
                            "<|tool_calls_section_begin|>..., Kimi Linear's; olmo3: <function_calls> name(key=value) "
                            "</function_calls>, OLMo Hybrid's); without it, requests with tools are refused")
    serve.add_argument("--reasoning-parser", choices=("qwen3",), default=None,
                       help="split a thinking model's <think>...</think> into message.reasoning_content")
    serve.add_argument("overrides", nargs="*", metavar="key=value",
                       help="model.gdn_* and model.dtype overrides, e.g. model.dtype=bfloat16; parallel.* "
                            "places the engine on a mesh of this host's devices, e.g. parallel.tensor=4 "
                            "parallel.data=2 (context=1)")
    _distributed_options(serve)
    ev = sub.add_parser("eval", help="evaluate with lm-evaluation-harness (its tasks, flags and output files)",
                        description="Run lm-evaluation-harness tasks in process on a gdnx run or a Hugging Face "
                                    "directory: scoring through the model on its mesh, generation through the "
                                    "batched engine (docs/evaluation.md). Needs lm-eval (pip install lm-eval).")
    ev.add_argument("--checkpoint", required=True,
                    help="a gdnx train.out_dir (its latest checkpoint) or a Hugging Face directory")
    ev.add_argument("--tasks", required=True, help="comma-separated task (or group) names, as lm-eval's --tasks")
    ev.add_argument("--include-path", default=None, help="a directory of task YAMLs (and their data) to add")
    ev.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    ev.add_argument("--limit", type=float, default=None,
                    help="at most N examples per task (a fraction below 1: that share); for checks")
    ev.add_argument("--batch-size", type=int, default=8, help="rows per scoring call, requests generated together "
                                                              "(default 8)")
    ev.add_argument("--output-path", default=None, help="a directory for the results JSON (and the samples)")
    ev.add_argument("--log-samples", action="store_true", help="also write each sample's requests and responses "
                                                               "(JSONL per task; needs --output-path)")
    ev.add_argument("--apply-chat-template", action="store_true", help="render prompts with the checkpoint's "
                                                                       "chat template")
    ev.add_argument("--seed", type=int, default=0, help="the few-shot sampler's and generation's seed (default 0)")
    ev.add_argument("overrides", nargs="*", metavar="key=value",
                    help="model.gdn_* and model.dtype overrides; parallel.* places the model on a mesh of this "
                         "host's devices (of every process's, with --distributed), e.g. parallel.tensor=4")
    _distributed_options(ev)
    export = sub.add_parser("export", help="a training run's newest intact checkpoint as a Hugging Face directory",
                            description="Write the run's newest intact checkpoint as config.json and safetensors "
                                        "(sharded with an index above 4 GiB) in the family's Hugging Face layout, "
                                        "with the run's tokenizer files: what transformers loads.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a gdnx train.out_dir")
    export.add_argument("--out", required=True, help="the directory to write (new or empty)")
    form = export.add_mutually_exclusive_group()
    form.add_argument("--merge-lora", action="store_true",
                      help="a LoRA run (train.lora): its adapters merged into the base weights, as a whole model")
    form.add_argument("--adapter", action="store_true",
                      help="a LoRA run: its adapters as a PEFT adapter directory (adapter_config.json, "
                           "adapter_model.safetensors) for the base model (model.init_from)")
    prep = sub.add_parser("prepare", help="tokenize text into memory-mapped shards for data.source=tokens",
                          description="Tokenize .txt / .jsonl files (or directories of them) into token shards "
                                      "with a document index and a validation split; a rerun on the same inputs "
                                      "does nothing.")
    prep.add_argument("inputs", nargs="+", help=".txt files (one document each), .jsonl files ({\"text\": ...} "
                                                "per line) or directories of them")
    prep.add_argument("--out", required=True, help="the directory to write (then: data.source=tokens data.path=OUT)")
    prep.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: raw bytes)")
    prep.add_argument("--val-fraction", type=float, default=0.05,
                      help="documents held out for evaluation (default 0.05)")
    prep.add_argument("--eos-token", default=None,
                      help="the tokenizer's end-of-document token (default: the first of <|endoftext|>, </s>, "
                           "<eos>, <|end_of_text|>, [SEP] it has)")
    plan = sub.add_parser("plan", help="compile one train step for a TPU slice from this host: bytes per chip, "
                                       "FLOPs, compile time",
                          description="Build the model abstractly, compile its sharded train step (the Pallas TPU "
                                      "kernel, compiled) for a TPU topology with libtpu, and print the bytes each "
                                      "chip holds, whether that fits its HBM, the compile time and the FLOPs per "
                                      "step. Needs jax[tpu] (libtpu); no TPU.")
    plan.add_argument("config", help=f"a YAML file or a bundled config ({', '.join(bundled_names())})")
    plan.add_argument("--topology", required=True,
                      help="a TPU slice: v4, v5e, v5p or v6e with its shape, e.g. v5p:4x4x4, v5e:4x4; with --serve "
                           "also N GPUs of one host: h100:8, h200:8, a100:8")
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="config overrides, e.g. parallel.fsdp=-1 parallel.data=1 train.batch_size=64")
    serving = plan.add_argument_group("--serve: the serving engine's programs instead (docs/serving.md)")
    serving.add_argument("--serve", action="store_true",
                         help="compile the engine's prefill, decode and verify programs (gdnx serve's) instead of a "
                              "train step: bytes per chip for the weights, the slots and the temporaries, the most "
                              "slots that fit, FLOPs per decode step")
    serving.add_argument("--max-slots", type=int, default=8, help="requests decoded together (default 8)")
    serving.add_argument("--max-length", type=int, default=4096,
                         help="prompt + generated tokens per request (default 4096)")
    serving.add_argument("--speculative", type=int, default=0, metavar="K",
                         help="draft tokens per verify pass (default 0: no verify program)")
    serving.add_argument("--decode-steps", type=int, default=8, help="tokens per slot per decode call (default 8)")
    serving.add_argument("--max-prefill-batch", type=int, default=None, metavar="N",
                         help="prompts prefilled together, at most (default: --max-slots)")
    serving.add_argument("--prefix-cache-mb", type=int, default=1024,
                         help="as gdnx serve's (default 1024; 0: off): with a prefix cache the prefill also returns "
                              "the states at block ends")
    bench = sub.add_parser("bench", help="op timings and train-step time/memory, GDN hybrid vs attention")
    bench.add_argument("--batch", type=int, default=4, help="train-step batch (default 4)")
    bench.add_argument("--seq-len", type=int, default=1024, help="train-step sequence length (default 1024)")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs per row, the median reported (default 5)")
    bench.add_argument("--quick", action="store_true",
                       help="small shapes and 2 repeats: a check that everything runs, in seconds")
    return parser


def _engine_options(group: argparse._ActionsContainer, max_length_default: str, prefix_cache_mb: int) -> None:
    """The batched engine's settings (generate --prompts-file, serve)."""
    group.add_argument("--max-slots", type=int, default=8, help="requests decoded together (default 8)")
    group.add_argument("--max-length", type=int, default=None,
                       help=f"prompt + generated tokens per request (default: {max_length_default})")
    group.add_argument("--prefix-cache-mb", type=int, default=prefix_cache_mb,
                       help=f"host memory for the prefix cache of shared prompt blocks (default {prefix_cache_mb}"
                            + ("; 0: off)" if prefix_cache_mb else ": off)"))
    group.add_argument("--speculative", type=int, default=0, metavar="K",
                       help="n-gram (prompt lookup) speculative decoding with K draft tokens (default 0: off)")
    group.add_argument("--batch-invariant", action="store_true",
                       help="each result bit-identical whatever else is batched with it (prefills block by block)")
    group.add_argument("--max-prefill-batch", type=int, default=None, metavar="N",
                       help="prompts prefilled together, at most (default: --max-slots); fewer bound the prefill's "
                            "memory (gdnx plan --serve measures it)")


def _distributed_options(command: argparse.ArgumentParser) -> None:
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


def _wants_distributed(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "distributed", False)) or any(
        getattr(args, k, None) is not None for k in ("coordinator", "num_processes", "process_id",
                                                     "heartbeat_timeout", "join_timeout"))


def _process_group(args: argparse.Namespace) -> ProcessGroup:
    from gdnx.distributed import HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S, process_group

    try:
        return process_group(args.coordinator, args.num_processes, args.process_id,
                             HEARTBEAT_TIMEOUT_S if args.heartbeat_timeout is None else args.heartbeat_timeout,
                             JOIN_TIMEOUT_S if args.join_timeout is None else args.join_timeout)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _start_distributed(args: argparse.Namespace) -> None:
    from gdnx.distributed import initialize, native_output_to_supervisor

    group = _process_group(args)
    native_output_to_supervisor()
    try:
        initialize(group, args.command)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _train(args) -> None:
    from gdnx.checkpoints.orbax import quiet_refused_writes
    from gdnx.training import build_trainer
    from gdnx.training.init_from import load_train_config

    overrides = list(args.overrides)
    name = args.config
    if name is not None and "=" in name:
        name, overrides = None, [name] + overrides
    config = load_train_config(name, overrides)
    try:
        trainer = build_trainer(config)
    except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
        raise ConfigError(str(e)) from None
    quiet_refused_writes()
    trainer.run()


def _prepare(args) -> None:
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from gdnx.data.prepare import prepare_corpus

    console = Console(stderr=True)
    with Progress("prepare", BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("prepare", total=None)
        try:
            meta = prepare_corpus([Path(p) for p in args.inputs], Path(args.out), tokenizer=args.tokenizer,
                                  eos_token=args.eos_token, val_fraction=args.val_fraction,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
    splits = meta["splits"]
    state = "up to date" if meta.get("up_to_date") else "written"
    console.print(f"{args.out}: {state}; train {splits['train']['tokens']:,} tokens in "
                  f"{splits['train']['documents']:,} documents, validation {splits['val']['tokens']:,} tokens in "
                  f"{splits['val']['documents']:,}; train with data.source=tokens data.path={args.out}",
                  highlight=False, soft_wrap=True)


def _export(args) -> None:
    from pathlib import Path

    from gdnx.export import Form, export_run

    try:
        form: Form = "merge_lora" if args.merge_lora else "adapter" if args.adapter else "model"
        step, notes = export_run(Path(args.run_dir), Path(args.out), form)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for line in notes:
        print(f"gdnx export: {line}", file=sys.stderr)
    how = (f"peft: PeftModel.from_pretrained(base, {str(args.out)!r})" if args.adapter else
           f"transformers: AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    print(f"gdnx export: step {step} of {args.run_dir} written to {args.out} ({how})", file=sys.stderr)


def _plan(args) -> None:
    from gdnx.config import load_config
    from gdnx.plan import describe, plan

    config = load_config(args.config, list(args.overrides))
    try:
        if args.serve:
            if args.prefix_cache_mb < 0:
                raise ValueError("--prefix-cache-mb: expected a non-negative integer")
            from gdnx.serving.plan import describe as describe_serving
            from gdnx.serving.plan import serve_plan

            print(describe_serving(serve_plan(config, args.topology, max_slots=args.max_slots,
                                              max_length=args.max_length, speculative=args.speculative,
                                              decode_steps=args.decode_steps,
                                              max_prefill_batch=args.max_prefill_batch,
                                              prefix_cache=args.prefix_cache_mb > 0)))
            return
        result = plan(config, args.topology)
    except ValueError as e:  # the topology, the mesh, a model field or an engine setting
        raise ConfigError(str(e)) from None
    print(describe(result))


def _dispatch(args) -> int:
    if _wants_distributed(args):
        _start_distributed(args)
    if args.command == "train":
        _train(args)
    elif args.command == "generate":
        from gdnx.cli_generate import run_generate

        return run_generate(args)
    elif args.command == "serve":
        from gdnx.cli_serve import run_serve

        run_serve(args)
    elif args.command == "eval":
        from gdnx.cli_eval import run_eval

        run_eval(args)
    elif args.command == "prepare":
        _prepare(args)
    elif args.command == "export":
        _export(args)
    elif args.command == "plan":
        _plan(args)
    elif args.command == "bench":
        from gdnx.bench import run_benchmarks

        for flag in ("batch", "seq_len", "repeats"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')}: expected a positive integer")
        if args.quick:
            run_benchmarks(batch=1, seq_len=256, repeats=2, op_tokens=256)
        else:
            run_benchmarks(batch=args.batch, seq_len=args.seq_len, repeats=args.repeats)
    return 0


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)


def main(argv: list[str] | None = None) -> int:
    from gdnx.checkpoints.orbax import CheckpointDamaged
    from gdnx.distributed import (PREEMPTED_STATUS, SUPERVISED, BarrierTimeout, exit_peer_lost, exit_run,
                                  peer_failure, supervise)
    from gdnx.files import DirectoryBusy
    from gdnx.training import NonFiniteStop, Preempted

    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (gdnx plan X --topology T key=value)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    say = lambda text: print(f"gdnx {args.command}: {text}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        if _wants_distributed(args) and SUPERVISED not in os.environ:
            _process_group(args)  # a bad option is refused before any process starts
            return supervise(argv, args.command)  # the work runs in a child: see gdnx.distributed
        return _dispatch(args)
    except (ConfigError, FileNotFoundError, CheckpointDamaged, DirectoryBusy) as e:
        say(f"error: {e}")
        return 2
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
        return 2
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
            from gdnx.loading import MEMORY_HINT as hint
        say(f"error: out of memory ({str(e).splitlines()[0][:160]}); {hint}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
