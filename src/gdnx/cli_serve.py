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


def _eos_ids(model, tok, chat) -> list[int]:
    """The model config's end-of-sequence ids, and the chat template's eos
    token (a chat model's end of turn, e.g. <|im_end|>)."""
    eos = model.config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    name = getattr(chat, "special", {}).get("eos_token") if chat is not None else None
    inner = getattr(tok, "tok", None)
    if name is not None and inner is not None and (found := inner.token_to_id(name)) is not None:
        ids.append(int(found))
    return sorted(set(ids))


def run_serve(args) -> None:
    from gdnx.serving.server import bind

    for flag in ("max_slots", "decode_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a positive integer")
    for flag in ("max_queue", "grace", "prefix_cache_mb", "speculative"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected a non-negative integer")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port: expected 0 (any free port) to 65535, got {args.port}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:  # the address first: a port in use is refused before a model loads
        sock = bind(args.host, args.port)
    except OSError as e:
        raise ConfigError(f"--port: cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    with contextlib.closing(sock):
        _serve(args, sock, api_key)


def _serve(args, sock, api_key: str | None) -> None:
    from gdnx.cli_generate import load_for_generation
    from gdnx.data.chat import ChatTemplate
    from gdnx.serving import Engine, EngineStats, NgramDrafter, SamplingParams
    from gdnx.serving.async_engine import AsyncEngine
    from gdnx.serving.metrics import Metrics
    from gdnx.serving.protocol import MAX_LOGPROBS
    from gdnx.serving.server import Served, run_server

    path = Path(args.checkpoint)
    try:
        found = load_for_generation(path, list(args.overrides), "serve")
    except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
        raise ConfigError(str(e)) from None
    model, tok = found.model, found.tokenizer
    chat = None
    if found.tokenizer_dir is not None:
        try:
            chat = ChatTemplate(found.tokenizer_dir)
        except ValueError as e:  # no template, or one jinja2 cannot read: chat is refused, completions served
            print(f"gdnx serve: no chat completions: {e}", file=sys.stderr)
    limit = model.config.max_position_embeddings
    max_length = min(limit, DEFAULT_MAX_LENGTH) if args.max_length is None else args.max_length
    if max_length > limit:
        raise ConfigError(f"--max-length: {max_length} exceeds the model's {limit} positions (max_position_embeddings)")
    try:
        engine = Engine(model, max_slots=args.max_slots, max_length=max_length,
                        prefix_cache_bytes=args.prefix_cache_mb * 2 ** 20, decode_steps=args.decode_steps,
                        speculative=NgramDrafter(args.speculative) if args.speculative else None,
                        batch_invariant=args.batch_invariant, tokenizer=tok, max_logprobs=MAX_LOGPROBS,
                        eos_token_ids=_eos_ids(model, tok, chat))
    except ValueError as e:
        field, _, rest = str(e).partition(":")
        raise ConfigError(f"--{field.replace('_', '-')}:{rest}") from None
    host, port = sock.getsockname()[:2]
    name = args.served_model_name or path.resolve().name
    print(f"gdnx serve: loaded {found.description}; compiling the first programs", file=sys.stderr, flush=True)
    engine.generate([[0]], SamplingParams(max_tokens=2, temperature=0.0))  # the shortest prompts' prefill
    engine.stats = EngineStats()
    engine.warm_up()  # every decode batch size
    served = Served(AsyncEngine(engine, Metrics(), args.max_queue), tok, name, chat, api_key)
    print(f"gdnx serve: serving {name!r} at http://{host}:{port}/v1 ({args.max_slots} slots, {max_length} tokens "
          f"each{', an API key' if api_key else ''}); SIGTERM or Ctrl-C stops it", file=sys.stderr, flush=True)
    run_server(served, sock, args.grace)
    print("gdnx serve: stopped", file=sys.stderr, flush=True)
