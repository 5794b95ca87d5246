"""`gdnx generate`: load a gdnx run (its latest checkpoint) or a Hugging Face
directory of any family gdnx builds, tokenize the prompt, stream the continuation."""

from __future__ import annotations

import sys
from typing import Any
from pathlib import Path

from flax import nnx

from gdnx.config.loading import ConfigError, apply_overrides
from gdnx.data.text import HFTokenizer, make_tokenizer


class _IdTokenizer:
    """MQAR models: prompts and outputs are token ids."""

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ConfigError("--prompt: this model was trained on MQAR; give token ids separated by spaces") from None

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids) + " "


GENERATE_MEMORY_HINT = ("shorten the prompt or --max-new-tokens, or load the weights in bfloat16 "
                        "(model.param_dtype=bfloat16 model.dtype=bfloat16)")
# what generate may change: how the model computes, not its shapes
_GENERATE_FIELDS = ("dtype", "param_dtype")


def _model_overrides(overrides: list[str]) -> dict:
    data = apply_overrides({}, overrides)
    extra = set(data) - {"model"}
    if extra:
        raise ConfigError(f"{sorted(extra)[0]}: generate takes model.* overrides only")
    model = data.get("model", {})
    for key in model:
        if not key.startswith("gdn_") and key not in _GENERATE_FIELDS:
            raise ConfigError(f"model.{key}: generate takes overrides of the model.gdn_* fields, model.dtype and "
                              "model.param_dtype only (the checkpoint fixes the architecture)")
    return model


def load_for_generation(path: Path, overrides: list[str]):
    """(model, tokenizer, what was loaded) from a gdnx out_dir or a Hugging Face directory."""
    from gdnx.checkpoints.orbax import CONFIG_FILE
    from gdnx.models import CausalLM
    from gdnx.checkpoints.orbax import is_run
    from gdnx.data.source import run_tokenizer
    from gdnx.runs import load_run

    if not path.is_dir():
        raise ConfigError(f"--checkpoint: no such directory {path}")
    model_overrides = _model_overrides(overrides)
    if is_run(path):
        try:
            run = load_run(path, model_overrides)
        except ValueError as e:
            if "not a gdnx run config" in str(e):
                raise ConfigError(f"--checkpoint: {e}") from None
            raise
        for line in run.notes:
            print(f"gdnx generate: {line}", file=sys.stderr)
        if run.config.data.source == "mqar":
            tok: Any = _IdTokenizer()
        else:  # the tokenizer the run's text was tokenized with (raw bytes when none)
            found = run_tokenizer(run.config)
            tok = make_tokenizer(None if found is None else str(found))
        return run.model, tok, f"step {run.step} of {path}"
    if (path / "config.json").is_file():
        model = CausalLM.from_pretrained(path, **model_overrides)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--checkpoint: {path} has no tokenizer.json to encode the prompt with")
        return model, HFTokenizer(str(path / "tokenizer.json")), str(path)
    raise ConfigError(f"--checkpoint: {path} is neither a gdnx run directory (checkpoints/ and {CONFIG_FILE}) "
                      "nor a Hugging Face directory (config.json)")


def run_generate(args) -> None:
    import jax
    import jax.numpy as jnp

    from gdnx.models.cache import cache_bytes
    from gdnx.training.loop import memory_capacity

    from gdnx.generate import check_sampling, generate, prefill_bytes

    try:
        check_sampling(args.temperature, args.top_p, args.max_new_tokens)
    except ValueError as e:
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None
    try:
        model, tok, loaded = load_for_generation(Path(args.checkpoint), list(args.overrides))
    except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
        raise ConfigError(str(e)) from None
    try:
        ids = tok.encode(args.prompt)
    except ConfigError:
        raise
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
                          f"{GENERATE_MEMORY_HINT}")
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
