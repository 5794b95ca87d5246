"""`gdnx generate`: load a gdnx run (its latest checkpoint) or a Hugging Face
directory of any family gdnx builds, tokenize the prompt, stream the continuation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flax import nnx

from gdnx.config.loading import ConfigError, apply_overrides, build_config
from gdnx.config.schema import Config
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


def _model_overrides(overrides: list[str]) -> dict:
    data = apply_overrides({}, overrides)
    extra = set(data) - {"model"}
    if extra:
        raise ConfigError(f"{sorted(extra)[0]}: generate takes model.* overrides only")
    return data.get("model", {})


def load_for_generation(path: Path, overrides: list[str]):
    """(model, tokenizer, what was loaded) from a gdnx out_dir or a Hugging Face directory."""
    from gdnx.checkpoints.orbax import CONFIG_FILE, load_params
    from gdnx.models import CausalLM

    if not path.is_dir():
        raise ConfigError(f"--checkpoint: no such directory {path}")
    model_overrides = _model_overrides(overrides)
    if (path / "checkpoints").is_dir() and (path / CONFIG_FILE).is_file():
        saved = json.loads((path / CONFIG_FILE).read_text())
        saved["model"] = {**saved["model"], **model_overrides}
        config: Config = build_config(saved)
        abstract = nnx.eval_shape(lambda: CausalLM(config.model))
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        params, step = load_params(path, abstract_params)
        tok = _IdTokenizer() if config.data.source == "mqar" else make_tokenizer(config.data.tokenizer)
        return nnx.merge(graphdef, params), tok, f"step {step} of {path}"
    if (path / "config.json").is_file():
        model = CausalLM.from_pretrained(path, **model_overrides)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--checkpoint: {path} has no tokenizer.json to encode the prompt with")
        return model, HFTokenizer(str(path / "tokenizer.json")), str(path)
    raise ConfigError(f"--checkpoint: {path} is neither a gdnx run directory (checkpoints/ and {CONFIG_FILE}) "
                      "nor a Hugging Face directory (config.json)")


def run_generate(args) -> None:
    import jax.numpy as jnp

    from gdnx.generate import check_sampling, generate

    try:
        check_sampling(args.temperature, args.top_p, args.max_new_tokens)
    except ValueError as e:
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None
    try:
        model, tok, loaded = load_for_generation(Path(args.checkpoint), list(args.overrides))
    except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
        raise ConfigError(str(e)) from None
    ids = tok.encode(args.prompt)
    if not ids:
        raise ConfigError("--prompt: encodes to no tokens")
    if max(ids) >= model.config.vocab_size or min(ids) < 0:
        raise ConfigError(f"--prompt: token ids must be in [0, {model.config.vocab_size})")
    print(f"loaded {loaded}; prompt of {len(ids)} tokens", file=sys.stderr)
    out: list[int] = []
    shown = ""

    def stream(tok_step):
        nonlocal shown
        out.append(int(tok_step[0]))
        text = tok.decode(out)
        # a multi-byte character shows once complete
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    generate(model, jnp.asarray([ids], jnp.int32), args.max_new_tokens, temperature=args.temperature,
             top_p=args.top_p, seed=args.seed, on_token=stream)
    sys.stdout.write("\n")
