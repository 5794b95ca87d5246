"""`gdnx generate`: load a gdnx run (its latest checkpoint) or a Hugging Face
directory of any family gdnx builds, tokenize the prompt, stream the continuation."""

from __future__ import annotations

import sys
from pathlib import Path

from flax import nnx

from gdnx.config.loading import ConfigError
from gdnx.errors import FieldError
from gdnx.loading import MEMORY_HINT, EngineSettings, build_engine, load


def run_generate(args) -> None:
    import jax
    import jax.numpy as jnp

    from gdnx.models.cache import cache_bytes
    from gdnx.training.loop import memory_capacity

    from gdnx.generate import check_sampling, generate, prefill_bytes

    try:
        check_sampling(args.temperature, args.top_p, args.max_new_tokens)
    except FieldError as e:
        raise ConfigError(f"--{e.field.replace('_', '-')}: {e.detail}") from None
    if args.prompts_file is not None:
        if args.out is None:
            raise ConfigError("--out: --prompts-file writes its results to a jsonl file; give its path")
        if jax.process_count() > 1:
            raise ConfigError("--prompts-file: the engine runs in one process; start gdnx generate without "
                              "--distributed")
        lines = read_prompts_file(Path(args.prompts_file))
    elif args.out is not None:
        raise ConfigError("--out: applies to --prompts-file")
    found = load(Path(args.checkpoint), list(args.overrides), "generate")
    model, tok, loaded = found.model, found.tokenizer, found.description
    if args.prompts_file is not None:
        run_prompts_file(args, found, lines)
        return
    try:
        ids = tok.encode(args.prompt)
    except FieldError as e:
        raise ConfigError(f"--{e.field}: {e.detail}") from None
    except Exception as e:  # a tokenizer's own error on text it cannot encode
        raise ConfigError(f"--prompt: cannot be encoded ({str(e).splitlines()[0][:120]})") from None
    if not ids:
        raise ConfigError("--prompt: encodes to no tokens")
    if max(ids) >= model.config.vocab_size or min(ids) < 0:
        raise ConfigError(f"--prompt: token ids must be in [0, {model.config.vocab_size})")
    limit = model.config.max_position_embeddings
    if len(ids) + args.max_new_tokens > limit:
        raise ConfigError(f"--max-new-tokens: the prompt's {len(ids)} tokens + {args.max_new_tokens} exceed the "
                          f"model's {limit} positions (max_position_embeddings)")
    total = len(ids) + args.max_new_tokens
    cache, prefill = cache_bytes(model, total), prefill_bytes(model, len(ids), total)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    have = memory_capacity(jax.local_devices()[:1])
    if weights + cache + prefill > have:
        raise ConfigError(f"--max-new-tokens: {total} tokens need {(weights + cache + prefill) / 2 ** 30:,.1f} GiB "
                          f"(weights {weights / 2 ** 30:,.1f}, the generation cache {cache / 2 ** 30:,.1f}, the "
                          f"prompt's pass {prefill / 2 ** 30:,.1f}) and the device holds {have / 2 ** 30:,.1f} GiB; "
                          f"{MEMORY_HINT}")
    # with several processes each generates the same tokens (same seed); process 0 shows them
    shows = jax.process_index() == 0
    if shows:
        print(f"loaded {loaded}; prompt of {len(ids)} tokens", file=sys.stderr)
    out: list[int] = []
    shown = ""

    def stream(tok_step):
        nonlocal shown
        out.append(int(tok_step[0]))
        text = tok.decode(out)
        # a multi-byte character shows once complete
        if shows and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    generate(model, jnp.asarray([ids], jnp.int32), args.max_new_tokens, temperature=args.temperature,
             top_p=args.top_p, seed=args.seed, on_token=stream)
    if shows:
        sys.stdout.write("\n")


# the sampling fields a line of a prompts file may set (SamplingParams')
_LINE_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "stop", "ignore_eos", "logprobs")


def read_prompts_file(path: Path) -> list[dict]:
    """The lines of a prompts file: JSON objects with a "prompt" string and
    optional sampling fields (refused in one line naming the line)."""
    import json

    if not path.is_file():
        raise ConfigError(f"--prompts-file: no such file {path}")
    lines = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--prompts-file: line {n}: not JSON ({e.msg})") from None
            if not isinstance(line, dict) or not isinstance(line.get("prompt"), str):
                raise ConfigError(f'--prompts-file: line {n}: expected an object with a "prompt" string')
            unknown = sorted(set(line) - {"prompt", *_LINE_FIELDS})
            if unknown:
                raise ConfigError(f"--prompts-file: line {n}: unknown field {unknown[0]!r} (expected prompt and "
                                  f"sampling fields: {', '.join(_LINE_FIELDS)})")
            line["_line"] = n
            lines.append(line)
    if not lines:
        raise ConfigError(f"--prompts-file: {path} holds no prompts")
    return lines


def run_prompts_file(args, found, lines: list[dict]) -> None:
    """Every line through the batched engine, results in order to --out."""
    import json
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gdnx.serving import SamplingParams

    model, tok, loaded = found.model, found.tokenizer, found.description
    requests = []
    for i, line in enumerate(lines):
        where = f"--prompts-file: line {line['_line']}"
        fields = {k: v for k, v in line.items() if k in _LINE_FIELDS}
        fields = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "seed": args.seed + i, **fields}
        try:
            params = SamplingParams(**fields)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {e}") from None
        try:
            ids = tok.encode(line["prompt"])
        except FieldError as e:
            raise ConfigError(f"{where}: {e.detail}") from None
        except Exception as e:  # a tokenizer's own error on text it cannot encode
            raise ConfigError(f"{where}: the prompt cannot be encoded ({str(e).splitlines()[0][:120]})") from None
        requests.append((ids, params, where))
    need = max(len(ids) + p.max_tokens for ids, p, _ in requests)
    max_length = need if args.max_length is None else args.max_length
    engine = build_engine(found, EngineSettings(
        max_slots=args.max_slots, max_length=max_length, prefix_cache_bytes=args.prefix_cache_mb * 2 ** 20,
        speculative=args.speculative, batch_invariant=args.batch_invariant))
    ids_of = {}
    for ids, params, where in requests:  # every line is checked before any runs
        try:
            engine.check(ids, params)
        except ValueError as e:
            hint = " (raise --max-length)" if args.max_length is not None and "max_length" in str(e) else ""
            raise ConfigError(f"{where}: {e}{hint}") from None
    print(f"loaded {loaded}; {len(requests)} prompts through {args.max_slots} slots", file=sys.stderr)
    start = time.perf_counter()
    results = {}
    with Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[rate]}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("generate", total=len(requests), rate="")
        for i, (ids, params, _) in enumerate(requests):
            ids_of[engine.add_request(ids, params)] = i
        while engine.has_unfinished():
            for event in engine.step():
                if event.completion is not None:
                    results[ids_of[event.request_id]] = event.completion
                    rate = engine.stats.generated_tokens / (time.perf_counter() - start)
                    bar.update(task, advance=1, rate=f"{rate:,.0f} tokens/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for i, line in enumerate(lines):
            c = results[i]
            record = {"prompt": line["prompt"], "completion": c.text, "tokens": c.tokens,
                      "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                      "cached_tokens": c.cached_tokens}
            if c.logprobs is not None:
                record["logprobs"] = [{"logprob": lp, "top": {str(k): v for k, v in top.items()}}
                                      for lp, top in c.logprobs]
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    s = engine.stats
    print(f"wrote {len(lines)} results to {out}: {s.generated_tokens} tokens in "
          f"{time.perf_counter() - start:.1f} s; prefix cache {s.cached_tokens} of {s.prompt_tokens} prompt tokens"
          + (f"; speculative acceptance {s.acceptance:.0%}" if args.speculative else ""), file=sys.stderr)
