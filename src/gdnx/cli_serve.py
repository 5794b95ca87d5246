"""`gdnx serve`: a gdnx run or a Hugging Face directory behind the
OpenAI-compatible HTTP server (gdnx.serving.server)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from gdnx.config.loading import ConfigError

API_KEY_ENV = "GDNX_API_KEY"
# the context a server gives each request when --max-length is not given (at most the model's positions)
DEFAULT_MAX_LENGTH = 4096
LISTEN_BACKLOG = 2048


def run_serve(args) -> None:
    from gdnx.serving.server import bind

    for flag in ("max_slots", "decode_steps", "max_request_bytes", "request_timeout"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a positive integer")
    for flag in ("max_queue", "grace", "prefix_cache_mb", "speculative"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a non-negative integer")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port: expected 0 (any free port) to 65535, got {args.port}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:  # the address first, listening: a port in use is refused before a model loads
        sock = bind(args.host, args.port)
        sock.listen(LISTEN_BACKLOG)  # a second server on this port now fails to bind (connections wait for it)
    except OSError as e:
        raise ConfigError(f"--port: cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    with contextlib.closing(sock):
        _serve(args, sock, api_key)


def _serve(args, sock, api_key: str | None) -> None:
    from gdnx.loading import EngineSettings, build_engine, chat_template, load
    from gdnx.serving import EngineStats, SamplingParams
    from gdnx.serving.async_engine import AsyncEngine
    from gdnx.serving.metrics import Metrics
    from gdnx.serving.protocol import MAX_LOGPROBS
    from gdnx.serving.server import Served, run_server

    path = Path(args.checkpoint)
    found = load(path, list(args.overrides), "serve")
    chat = chat_template(found, "serve")  # none: chat completions are refused, completions served
    max_length = min(found.max_positions, DEFAULT_MAX_LENGTH) if args.max_length is None else args.max_length
    engine = build_engine(found, EngineSettings(
        max_slots=args.max_slots, max_length=max_length, prefix_cache_bytes=args.prefix_cache_mb * 2 ** 20,
        speculative=args.speculative, batch_invariant=args.batch_invariant, decode_steps=args.decode_steps,
        max_logprobs=MAX_LOGPROBS), chat)
    host, port = sock.getsockname()[:2]
    name = args.served_model_name or path.resolve().name
    print(f"gdnx serve: loaded {found.description}; compiling the first programs", file=sys.stderr, flush=True)
    engine.generate([[0]], SamplingParams(max_tokens=1, temperature=0.0))  # the shortest prompts' prefill
    engine.stats = EngineStats()
    engine.warm_up()  # every decode batch size
    served = Served(AsyncEngine(engine, Metrics(), args.max_queue), found.tokenizer, name, max_length, chat, api_key,
                    max_request_bytes=args.max_request_bytes, request_timeout=float(args.request_timeout))
    print(f"gdnx serve: serving {name!r} at http://{host}:{port}/v1 ({args.max_slots} slots, {max_length} tokens "
          f"each{', an API key' if api_key else ''}); SIGTERM or Ctrl-C stops it", file=sys.stderr, flush=True)
    run_server(served, sock, args.grace)
    print("gdnx serve: stopped", file=sys.stderr, flush=True)
