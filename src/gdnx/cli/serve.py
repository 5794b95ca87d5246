"""`gdnx serve`: a gdnx run or a Hugging Face directory behind the
OpenAI-compatible HTTP server (gdnx.serving.server).

Over several processes (--distributed) every process loads the model onto
its part of the parallel.* mesh and builds the same engine; process 0
listens and leads, the others follow its steps (gdnx.serving.spmd)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from gdnx.cli.options import distributed_options, engine_options, overrides, quantize_option
from gdnx.config.reading import ConfigError
from gdnx.serving.config import EngineConfig

API_KEY_ENV = "GDNX_API_KEY"
# the context a server gives each request when --max-length is not given (at most the model's positions)
DEFAULT_MAX_LENGTH = EngineConfig().max_length
LISTEN_BACKLOG = 2048
STOP_WAIT_S = 60  # how long process 0, stopping, waits for the others to read the word



def add_parser(sub) -> None:
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
    engine_options(serve, "the model's positions, at most 4096", 1024)
    serve.add_argument("--decode-steps", type=int, default=EngineConfig().decode_steps,
                       help=f"tokens per slot per decode round trip (default {EngineConfig().decode_steps}; fewer: "
                            "smoother streams)")
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
    serve.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="where compiled programs are kept for the next start (default: $GDNX_COMPILE_CACHE, else "
                            "~/.cache/gdnx/compiled; off: none); an entry serves only the very program it holds")
    serve.add_argument("--tool-call-parser", choices=("hermes", "kimi_k2", "olmo3"), default=None,
                       help="parse tool calls from chat outputs in the format of the checkpoint's template (hermes: "
                            "<tool_call>{...}</tool_call>, Qwen3-Next's and Qwen3.5's; kimi_k2: "
                            "<|tool_calls_section_begin|>..., Kimi Linear's; olmo3: <function_calls> name(key=value) "
                            "</function_calls>, OLMo Hybrid's); without it, requests with tools are refused")
    serve.add_argument("--reasoning-parser", choices=("qwen3",), default=None,
                       help="split a thinking model's <think>...</think> into message.reasoning_content")
    quantize_option(serve)
    serve.add_argument("overrides", nargs="*", metavar="key=value",
                       help="model.gdn_* and model.dtype overrides, e.g. model.dtype=bfloat16; parallel.* "
                            "places the engine on a mesh of this host's devices, e.g. parallel.tensor=4 "
                            "parallel.data=2 (context=1)")
    distributed_options(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args) -> None:
    from gdnx.inference import speculation
    from gdnx.serving.server import bind

    for flag in ("max_slots", "decode_steps", "max_request_bytes", "request_timeout"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a positive integer")
    speculation(args.speculative)  # its form, before the checkpoint loads
    for flag in ("max_queue", "grace", "prefix_cache_mb"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a non-negative integer")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port: expected 0 (any free port) to 65535, got {args.port}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    from gdnx import compile_cache

    compile_cache.cpu_flags()
    try:
        compile_cache.use(args.compile_cache)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if _process() > 0:  # a follower: process 0 listens
        _serve(args, None, api_key)
        return
    try:  # the address first, listening: a port in use is refused before a model loads
        sock = bind(args.host, args.port)
        sock.listen(LISTEN_BACKLOG)  # a second server on this port now fails to bind (connections wait for it)
    except OSError as e:
        raise ConfigError(f"--port: cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    with contextlib.closing(sock):
        _serve(args, sock, api_key)


def _process() -> int:
    import jax

    return jax.process_index()


def _serve(args, sock, api_key: str | None) -> None:
    from gdnx.distributed import JOIN_TIMEOUT_S
    from gdnx.signals import handled

    # until the server's (or a follower's) own handlers take over: a stop ends the start-up at once
    with handled(_stop_starting):
        engine, found, chat, max_length = _start(args)
        name = args.served_model_name or Path(args.checkpoint).resolve().name
        join_s = JOIN_TIMEOUT_S if args.join_timeout is None else args.join_timeout
        if sock is None:
            _follow(engine, join_s)
            return
        _lead(args, sock, api_key, engine, found, chat, max_length, name, join_s)


def _stop_starting(signum, frame) -> None:
    """SIGTERM or Ctrl-C while the server loads and compiles: one line, and
    out at once (status 0 for SIGTERM, 130 for Ctrl-C); nothing to drain."""
    import signal

    name = signal.Signals(signum).name
    print(f"gdnx serve: {name} received while starting; stopped", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130 if signum == signal.SIGINT else 0)


def _start(args):
    """The model loaded and its engine built and warmed up: (engine, the
    loaded checkpoint, its chat template, max_length)."""
    from gdnx.distributed import agree
    from gdnx.errors import FieldError
    from gdnx.inference import build_engine, chat_template, engine_config, load, speculation
    from gdnx.serving import EngineStats
    from gdnx.serving.runner import TooManyPrograms
    from gdnx.serving.protocol import MAX_LOGPROBS

    path = Path(args.checkpoint)
    # every process must build the same engine (the scheduler's choices are made on each): agreed before loading
    try:
        agree("serve", {"--checkpoint": str(path.resolve()), "overrides": sorted(overrides(args)),
                        "--max-slots": args.max_slots, "--max-length": args.max_length,
                        "--prefix-cache-mb": args.prefix_cache_mb, "--speculative": args.speculative,
                        "--draft-rows": args.draft_rows,
                        "--batch-invariant": args.batch_invariant, "--decode-steps": args.decode_steps,
                        "--max-prefill-batch": args.max_prefill_batch, "--warm-up": args.warm_up})
    except FieldError as e:
        raise ConfigError(str(e)) from None
    found = load(path, overrides(args), "serve")
    chat = chat_template(found, "serve")  # none: chat completions are refused, completions served
    max_length = min(found.max_positions, DEFAULT_MAX_LENGTH) if args.max_length is None else args.max_length
    engine = build_engine(found, engine_config(
        max_slots=args.max_slots, max_length=max_length, prefix_cache_bytes=args.prefix_cache_mb * 2 ** 20,
        **speculation(args.speculative, found.model.config), draft_rows=args.draft_rows,
        batch_invariant=args.batch_invariant,
        decode_steps=args.decode_steps,
        max_logprobs=MAX_LOGPROBS, max_prefill_batch=args.max_prefill_batch), chat)
    what = "every program" if args.warm_up == "all" else "the decode steps"
    print(f"gdnx serve: loaded {found.description}; compiling {what} (--warm-up {args.warm_up})", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    try:
        ran = engine.warm_up(prefill=args.warm_up == "all")
    except TooManyPrograms as e:
        raise ConfigError(f"--warm-up {args.warm_up}: {e}") from None
    engine.stats = EngineStats()
    print(f"gdnx serve: {ran} programs ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return engine, found, chat, max_length


def _lead(args, sock, api_key: str | None, engine, found, chat, max_length: int, name: str, join_s: int) -> None:
    """Process 0 (or the only one): the HTTP server over the engine, until it stops."""
    from gdnx.distributed import exit_peer_lost, is_distributed, wait_for_first
    from gdnx.serving.async_engine import AsyncEngine
    from gdnx.serving.metrics import Metrics
    from gdnx.serving.server import Served, run_server
    from gdnx.serving.spmd import Leader, Links, RuntimeChannel

    leader = Leader(engine, RuntimeChannel()) if is_distributed() else engine
    async_engine = AsyncEngine(leader, Metrics(), args.max_queue)
    links = Links(async_engine.lose, join_s) if is_distributed() else None
    served = Served(async_engine, found.tokenizer, name, max_length, chat, api_key,
                    max_request_bytes=args.max_request_bytes, request_timeout=float(args.request_timeout),
                    tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    host, port = sock.getsockname()[:2]
    print(f"gdnx serve: serving {name!r} at http://{host}:{port}/v1 ({args.max_slots} slots, {max_length} tokens "
          f"each{', an API key' if api_key else ''}); SIGTERM or Ctrl-C stops it", file=sys.stderr, flush=True)
    run_server(served, sock, args.grace)
    if async_engine.lost is not None:  # its requests have ended with the news; status 4, as gdnx train
        exit_peer_lost("serve", async_engine.lost)
    if links is not None:
        links.close()
        wait_for_first("serve-stopped", STOP_WAIT_S)  # the followers have read the word to stop
    print("gdnx serve: stopped", file=sys.stderr, flush=True)


def _follow(engine, join_s: int) -> None:
    """A process other than 0: its engine takes process 0's steps until process 0 stops."""
    from gdnx.distributed import exit_peer_lost, wait_for_first
    from gdnx.serving.spmd import Links, RuntimeChannel, follow
    from gdnx.signals import handled

    links = Links(lambda what: exit_peer_lost("serve", what), join_s)
    print(f"gdnx serve: process {_process()} follows process 0's steps", file=sys.stderr, flush=True)
    with handled(_note_signal):
        follow(engine, RuntimeChannel())
    links.close()
    wait_for_first("serve-stopped", STOP_WAIT_S)
    print("gdnx serve: stopped", file=sys.stderr, flush=True)


def _note_signal(signum, frame) -> None:
    """A follower stops when process 0 says so (after its requests in
    flight are done), so SIGTERM and SIGINT, which a cluster sends every
    process, are noted and ignored; process 0 drains and then stops all."""
    import signal

    print(f"gdnx serve: {signal.Signals(signum).name} received: this process stops with process 0",
          file=sys.stderr, flush=True)
