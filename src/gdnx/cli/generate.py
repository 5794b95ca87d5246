"""`gdnx generate`: load a gdnx run (its latest checkpoint) or a Hugging Face
directory of any family gdnx builds, tokenize the prompt, stream the continuation."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from gdnx.config.reading import ConfigError
from gdnx.errors import FieldError
from gdnx.cli.options import distributed_options, engine_options, overrides, quantize_option

FAILED_STATUS = 1  # a prompts file ran to its end, and some of its requests failed (error records in --out)
# seeds are 64-bit: a request's key is made of its seed's two 32-bit halves
MAX_SEED = 2 ** 63



def add_parser(sub) -> None:
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
    engine_options(gen.add_argument_group("the engine (--prompts-file)"), "the longest line's need", 0)
    quantize_option(gen)
    gen.add_argument("overrides", nargs="*", metavar="key=value",
                     help="model.gdn_* and model.dtype overrides, e.g. model.gdn_implementation=xla; parallel.* "
                          "places the model on a mesh of this host's devices as gdnx train does, e.g. "
                          "parallel.tensor=4 (the batched engine: context=1)")
    distributed_options(gen)
    gen.set_defaults(run=run_generate)


def run_generate(args) -> int:
    """Returns the exit status (FAILED_STATUS when a prompts file's request failed)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdnx.inference import MEMORY_HINT, load
    from gdnx.measure import stored_bytes
    from gdnx.models.cache import cache_bytes
    from gdnx.training.loop import memory_capacity

    from gdnx.generate import check_sampling, generate, prefill_bytes
    from gdnx.serving.output import IncrementalDetokenizer

    try:
        check_sampling(args.temperature, args.top_p, args.max_new_tokens)
    except FieldError as e:
        raise ConfigError(f"--{e.field.replace('_', '-')}: {e.detail}") from None
    if not 0 <= args.seed < MAX_SEED:
        raise ConfigError(f"--seed: expected an integer in [0, 2**63), got {args.seed}")
    if args.prompts_file is not None:
        if args.out is None:
            raise ConfigError("--out: --prompts-file writes its results to a jsonl file; give its path")
        if jax.process_count() > 1:
            raise ConfigError("--prompts-file: runs in one process (gdnx serve runs the engine over several); start "
                              "gdnx generate without --distributed")
        lines = read_prompts_file(Path(args.prompts_file))
        done = check_out(Path(args.out), Path(args.prompts_file), args.resume)  # before the model loads
        if done > len(lines):
            raise ConfigError(f"--resume: {args.out} holds {done} results, more than the {len(lines)} prompts of "
                              f"{args.prompts_file}; is it another file's output?")
        if args.seed + len(lines) > MAX_SEED:
            raise ConfigError(f"--seed: line i draws with --seed + i, past 2**63 for {len(lines)} lines")
    elif args.out is not None or args.resume:
        raise ConfigError(f"{'--out' if args.out is not None else '--resume'}: applies to --prompts-file")
    elif (flag := _engine_flag_given(args)) is not None:
        raise ConfigError(f"{flag}: applies to --prompts-file (the batched engine); --prompt decodes with the plain "
                          "loop, a token at a time")
    found = load(Path(args.checkpoint), overrides(args), "generate")
    model, tok, loaded = found.model, found.tokenizer, found.description
    if args.prompts_file is not None:
        return run_prompts_file(args, found, lines, done)
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
    mesh = found.mesh  # the weights are on it (gdnx.inference.load)
    total = len(ids) + args.max_new_tokens
    # per device: its share of the weights; the cache and the prompt's pass counted whole (an upper bound)
    cache, prefill = cache_bytes(model, total), prefill_bytes(model, len(ids), total)
    weights = sum(stored_bytes(x.addressable_shards[0].data.shape, x.dtype) for x in jax.tree.leaves(nnx.state(model)))
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
    # the engine's incremental detokenizer: a window of tokens per step, a multi-byte character once complete
    text = IncrementalDetokenizer(tok.decode)

    def stream(tok_step):
        new = text.add([int(tok_step[0])])
        if shows and new:
            sys.stdout.write(new)
            sys.stdout.flush()

    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        generate(model, jnp.asarray([ids], jnp.int32), args.max_new_tokens, temperature=args.temperature,
                 top_p=args.top_p, seed=args.seed, on_token=stream)
    if shows:
        sys.stdout.write(text.flush() + "\n")
    return 0


def _drafting(stats, engine) -> str:
    """What speculative decoding did: the drafts proposed and accepted, or
    that none was proposed and why."""
    if stats.drafted_tokens:
        return (f"; speculative: {stats.accepted_tokens} of {stats.drafted_tokens} drafted tokens accepted "
                f"({stats.acceptance:.0%})")
    rows = engine.draft_rows  # the config's, or the platform's default
    return (f"; speculative: no draft proposed (drafts are verified while at most --draft-rows={rows} slots decode; "
            f"more decoded at once here)" if rows < engine.config.max_slots else "; speculative: no draft proposed")


def _engine_flag_given(args) -> str | None:
    """The first engine setting given away from its default (they shape the
    batched engine that --prompts-file runs, which --prompt does not)."""
    from gdnx.serving import EngineConfig

    default = EngineConfig()
    given = {"--speculative": args.speculative != str(default.draft_tokens),
             "--draft-rows": args.draft_rows != default.draft_rows, "--max-slots": args.max_slots != default.max_slots,
             "--max-length": args.max_length is not None, "--prefix-cache-mb": args.prefix_cache_mb != 0,
             "--batch-invariant": args.batch_invariant, "--max-prefill-batch": args.max_prefill_batch is not None}
    return next((flag for flag, set_ in given.items() if set_), None)


# the sampling fields a line of a prompts file may set (SamplingParams')
_LINE_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "stop", "ignore_eos", "logprobs")


# a line's output constraint, as the server takes it (docs/serving.md)
_CONSTRAINTS = ("response_format", "structured_outputs")


def _structured(line: dict, where: str):
    """The line's Structured constraint (or None), as the server reads response_format and structured_outputs."""
    import pydantic

    from gdnx.serving.protocol import RequestError, ResponseFormat, StructuredOutputs, structured

    try:
        rf = ResponseFormat.model_validate(line["response_format"]) if "response_format" in line else None
        so = StructuredOutputs.model_validate(line["structured_outputs"]) if "structured_outputs" in line else None
        return structured(rf, so)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        name = "response_format" if "response_format" in line else "structured_outputs"
        at = ".".join(str(x) for x in err["loc"])
        raise ConfigError(f"{where}: {name}{'.' + at if at else ''}: {err['msg']}") from None
    except (RequestError, FieldError) as e:
        raise ConfigError(f"{where}: {e}") from None


def read_prompts_file(path: Path) -> list[dict]:
    """The lines of a prompts file: JSON objects with a "prompt" string and
    optional sampling fields (refused in one line naming the line)."""
    import json

    if not path.is_file():
        raise ConfigError(f"--prompts-file: no such file {path}")
    lines = []
    try:
        raw = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        at = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"--prompts-file: line {at}: not UTF-8 text (byte {e.start}); a .jsonl file is "
                          "UTF-8") from None
    for n, text in enumerate(raw.split("\n"), 1):  # JSON lines end at \n only
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--prompts-file: line {n}: not JSON ({e.msg})") from None
        if not isinstance(line, dict) or not isinstance(line.get("prompt"), str):
            raise ConfigError(f'--prompts-file: line {n}: expected an object with a "prompt" string')
        unknown = sorted(set(line) - {"prompt", *_LINE_FIELDS, *_CONSTRAINTS})
        if unknown:
            raise ConfigError(f"--prompts-file: line {n}: unknown field {unknown[0]!r} (expected prompt, sampling "
                              f"fields: {', '.join(_LINE_FIELDS)}, and {' or '.join(_CONSTRAINTS)})")
        line["_line"] = n
        lines.append(line)
    if not lines:
        raise ConfigError(f"--prompts-file: {path} holds no prompts")
    return lines


def check_out(out: Path, prompts: Path, resume: bool) -> int:
    """Refuse an --out that cannot take the results, before the model loads:
    a directory, the prompts file itself, a place that is not writable.
    Returns how many results --out holds already (with --resume; a last
    line cut short is dropped), else 0."""
    import json
    import os

    if out.is_dir():
        raise ConfigError(f"--out: {out} is a directory; give a file path")
    if out.exists() and prompts.exists() and out.resolve() == prompts.resolve():
        raise ConfigError(f"--out: {out} is the prompts file; give another path")
    parent = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        raise ConfigError(f"--out: {parent} is not a directory")
    if not os.access(out if out.exists() else parent, os.W_OK):
        raise ConfigError(f"--out: {out if out.exists() else parent} is not writable")
    if not resume or not out.exists():
        return 0
    kept = []
    for text in out.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        try:
            if not text.endswith("\n") or "error" in json.loads(text):
                raise ValueError
        except ValueError:
            break
        kept.append(text)
    # a line cut short by a kill, and a request that failed, run again (with every line after them)
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(kept)
    return len(kept)


def _record(line: dict, c) -> str:
    import json

    record = {"prompt": line["prompt"], "completion": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason,
              "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens}
    if c.logprobs is not None:
        record["logprobs"] = [{"logprob": lp, "top": {str(k): v for k, v in top.items()}} for lp, top in c.logprobs]
    return json.dumps(record, ensure_ascii=False) + "\n"


def _failure(line: dict, error: str) -> str:
    import json

    return json.dumps({"prompt": line["prompt"], "line": line["_line"], "error": error}, ensure_ascii=False) + "\n"


class _Stopped(Exception):
    """SIGTERM while generating."""


def run_prompts_file(args, found, lines: list[dict], done: int) -> int:
    """Every line after the first `done` through the batched engine; each
    result written to --out as soon as it and every earlier one are done, a
    request that failed as an error record in its place. Ctrl-C or SIGTERM
    leaves the finished results there (--resume goes on). Returns the exit
    status: FAILED_STATUS when a request failed, else 0."""
    import signal
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gdnx.distributed import PREEMPTED_STATUS
    from gdnx.inference import build_engine, engine_config, speculation
    from gdnx.serving import SamplingParams
    from gdnx.serving.offline import Finished, run_to_completion

    tok, loaded = found.tokenizer, found.description
    requests = []
    for i, line in enumerate(lines):
        where = f"--prompts-file: line {line['_line']}"
        fields = {k: v for k, v in line.items() if k in _LINE_FIELDS}
        fields = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "seed": args.seed + i, **fields}
        try:
            params = SamplingParams(**fields, structured=_structured(line, where))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {e}") from None
        try:
            ids = tok.encode(line["prompt"])
        except FieldError as e:
            raise ConfigError(f"{where}: {e.detail}") from None
        except Exception as e:  # a tokenizer's own error on text it cannot encode
            raise ConfigError(f"{where}: the prompt cannot be encoded ({str(e).splitlines()[0][:120]})") from None
        requests.append((ids, params, where))
    if args.max_length is None:  # the engine is sized by the longest line: a line past the model is that line's
        for ids, p, where in requests:
            if len(ids) + p.max_tokens > found.max_positions:
                raise ConfigError(f"{where}: {len(ids)} prompt tokens + max_tokens {p.max_tokens} = "
                                  f"{len(ids) + p.max_tokens} exceed the model's {found.max_positions} positions "
                                  "(max_position_embeddings); shorten the prompt or lower max_tokens")
    need = max(len(ids) + p.max_tokens for ids, p, _ in requests)
    max_length = need if args.max_length is None else args.max_length
    engine = build_engine(found, engine_config(
        max_slots=args.max_slots, max_length=max_length, prefix_cache_bytes=args.prefix_cache_mb * 2 ** 20,
        **speculation(args.speculative, found.model.config), draft_rows=args.draft_rows,
        batch_invariant=args.batch_invariant,
        max_prefill_batch=args.max_prefill_batch))
    for ids, params, where in requests:  # every line is checked before any runs
        try:
            engine.check(ids, params)
        except ValueError as e:
            hint = " (raise --max-length)" if args.max_length is not None and "max_length" in str(e) else ""
            raise ConfigError(f"{where}: {e}{hint}") from None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = list(range(done, len(requests)))
    print(f"loaded {loaded}; {len(todo)} prompts through {args.max_slots} slots"
          + (f" ({done} done already in {out})" if done else ""), file=sys.stderr)
    start = time.perf_counter()
    results: dict[int, Finished] = {}
    written = done
    failed: list[int] = []  # the prompts file's line numbers

    def stop(signum, frame):
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with open(out, "a" if done else "w", encoding="utf-8") as f, \
                Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         TextColumn("{task.fields[rate]}"), console=Console(stderr=True)) as bar:
            task = bar.add_task("generate", total=len(requests), completed=done, rate="")
            for done_ in run_to_completion(engine, [requests[i][:2] for i in todo]):
                results[todo[done_.position]] = done_
                while written in results:  # in input order, each as soon as every earlier one is done
                    finished = results.pop(written)
                    if finished.error is not None:
                        failed.append(lines[written]["_line"])
                        f.write(_failure(lines[written], finished.error))
                    else:
                        f.write(_record(lines[written], finished.completion))
                    written += 1
                f.flush()
                rate = engine.stats.generated_tokens / (time.perf_counter() - start)
                bar.update(task, advance=1, rate=f"{rate:,.0f} tokens/s")
    except (KeyboardInterrupt, _Stopped) as e:
        why = "Ctrl-C" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
        print(f"gdnx generate: stopped by {why}: {written} of {len(lines)} results in {out}; run the same command "
              "with --resume to generate the rest", file=sys.stderr, flush=True)
        if isinstance(e, KeyboardInterrupt):
            raise
        sys.exit(PREEMPTED_STATUS)
    finally:
        signal.signal(signal.SIGTERM, previous)
    s = engine.stats
    failures = f"; {len(failed)} of them failed (line{'s' if len(failed) > 1 else ''} " \
        f"{', '.join(map(str, failed[:8]))}{', ...' if len(failed) > 8 else ''}: error records in {out})" \
        if failed else ""
    print(f"wrote {len(lines) - done} results to {out}{failures}: {s.generated_tokens} tokens in "
          f"{time.perf_counter() - start:.1f} s; prefix cache {s.cached_tokens} of {s.prompt_tokens} prompt tokens"
          + (_drafting(s, engine) if engine.draft_tokens else ""), file=sys.stderr)
    return FAILED_STATUS if failed else 0
