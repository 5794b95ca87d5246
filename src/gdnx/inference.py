"""One way from a checkpoint to something that generates: a gdnx run or a
Hugging Face directory, `model.*` overrides and the engine's settings
become a model, its tokenizer, its chat template and an Engine.
`gdnx generate` and `gdnx serve` both load through here.

Engine settings arrive as an EngineConfig (gdnx.serving.config);
ENGINE_FLAGS names the command-line flag of each field, so a refused field
is reported as the flag the user typed.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from gdnx.config.reading import ConfigError, apply_overrides
from gdnx.errors import FieldError

# the command-line flag of each engine field (a refusal names the flag)
ENGINE_FLAGS = {"max_slots": "--max-slots", "max_length": "--max-length", "prefix_cache_bytes": "--prefix-cache-mb",
                "draft_tokens": "--speculative", "draft_method": "--speculative", "draft_rows": "--draft-rows",
                "batch_invariant": "--batch-invariant",
                "decode_steps": "--decode-steps", "max_logprobs": "--max-logprobs", "mesh": "parallel",
                "max_prefill_batch": "--max-prefill-batch"}

MEMORY_HINT = ("shorten the prompt or --max-new-tokens, or load the weights in bfloat16 "
               "(model.param_dtype=bfloat16 model.dtype=bfloat16)")
# what a loaded checkpoint may change: how the model computes, not its shapes
_OVERRIDABLE = ("dtype", "param_dtype", "scan_layers", "quantize", "quantize_block", "quantize_activations")


class IdTokenizer:
    """MQAR models: prompts and outputs are token ids separated by spaces."""

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise FieldError("prompt", "this model was trained on MQAR; give token ids separated by "
                             "spaces") from None

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids) + " "

    def token_id(self, text: str) -> int | None:
        return None


def model_overrides(overrides: list[str], command: str) -> dict:
    """The model.* overrides a loaded checkpoint may take (its gdn_* fields,
    dtype, param_dtype and, for a Hugging Face directory, scan_layers);
    anything else but parallel.* is refused naming the key."""
    data = apply_overrides({}, overrides)
    extra = set(data) - {"model", "parallel"}
    if extra:
        raise ConfigError(f"{sorted(extra)[0]}: {command} takes model.* and parallel.* overrides only")
    model = data.get("model", {})
    for key in model:
        if not key.startswith("gdn_") and key not in _OVERRIDABLE:
            raise ConfigError(f"model.{key}: {command} takes overrides of the model.gdn_* fields, model.dtype, "
                              "model.param_dtype, model.scan_layers and model.quantize(_block|_activations) only (the "
                              "checkpoint fixes the architecture)")
    return model


def parallel_mesh(overrides: list[str]) -> Any:
    """The device mesh the parallel.* overrides ask for (gdnx train's
    section, docs/sharding.md), or None when there are none: the model then
    runs on one device. Refusals name the field."""
    from pydantic import ValidationError

    from gdnx.config.schema import ParallelConfig
    from gdnx.parallel import make_mesh

    fields = apply_overrides({}, overrides).get("parallel")
    if not fields:
        return None
    try:
        cfg = ParallelConfig(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ConfigError(f"parallel{'.' + where if where else ''}: {err['msg']}") from None
    try:
        return make_mesh(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclasses.dataclass
class Loaded:
    """A model to generate with: its tokenizer, the directory holding the
    tokenizer's files (chat template) if any, what was loaded, the mesh
    its weights are placed on (None: one device), and the end-of-document
    id a run's text was tokenized with when its model config names no
    end-of-sequence id (raw bytes: 0)."""
    model: Any
    tokenizer: Any
    description: str
    tokenizer_dir: Path | None
    mesh: Any = None
    document_eos: int | None = None

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)


def load(path: Path, overrides: list[str], command: str) -> Loaded:
    """The model and tokenizer of a gdnx out_dir or a Hugging Face
    directory. Raises ConfigError naming --checkpoint or the override."""
    from gdnx.checkpoints.orbax import CONFIG_FILE, is_run
    from gdnx.data.prepare import Encoder
    from gdnx.data.source import run_tokenizer
    from gdnx.data.text import HFTokenizer, make_tokenizer
    from gdnx.models import CausalLM
    from gdnx.runs import NotARun, load_run

    if not path.is_dir():
        raise ConfigError(f"--checkpoint: no such directory {path}")
    model_fields = model_overrides(overrides, command)
    mesh = parallel_mesh(overrides)
    try:
        if is_run(path):
            if model_fields.get("quantize", "none") != "none":
                raise ConfigError("model.quantize: a gdnx run restores as it was trained; export it (gdnx export) "
                                  "and quantize the Hugging Face directory on load")
            if "scan_layers" in model_fields:
                raise ConfigError("model.scan_layers: a gdnx run's checkpoint restores in the layout it was trained "
                                  "in (a Hugging Face directory loads in either)")
            try:
                run = load_run(path, model_fields)
            except NotARun as e:
                raise ConfigError(f"--checkpoint: {e}") from None
            for line in run.notes:
                print(f"gdnx {command}: {line}", file=sys.stderr)
            if mesh is not None:  # a run's weights load whole: placed as training places them
                from flax import nnx

                from gdnx.parallel.params import shard
                nnx.update(run.model, shard(nnx.state(run.model), run.model.config, mesh))
            found, document_eos = None, None
            if run.config.data.source == "mqar":
                tok: Any = IdTokenizer()
            else:  # the tokenizer the run's text was tokenized with (raw bytes when none)
                found = run_tokenizer(run.config)
                tok = make_tokenizer(None if found is None else str(found))
                if run.model.config.eos_token_id is None:  # its documents' end, as training read them
                    document_eos = Encoder(None if found is None else str(found), run.config.data.eos_token).eos
            return Loaded(run.model, tok, f"step {run.step} of {path}", None if found is None else found.parent,
                          mesh, document_eos)
        if (path / "config.json").is_file():
            model = CausalLM.from_pretrained(path, mesh=mesh, **model_fields)  # each device reads its part
            if not (path / "tokenizer.json").is_file():
                raise ConfigError(f"--checkpoint: {path} has no tokenizer.json to encode the prompt with")
            return Loaded(model, HFTokenizer(str(path / "tokenizer.json")), str(path), path, mesh)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
        raise ConfigError(str(e)) from None
    raise ConfigError(f"--checkpoint: {path} is neither a gdnx run directory (checkpoints/ and {CONFIG_FILE}) "
                      "nor a Hugging Face directory (config.json)")


def chat_template(loaded: Loaded, command: str) -> Any:
    """The checkpoint's chat template, or None (said once on stderr) when it
    has none or jinja2 cannot read it."""
    from gdnx.data.chat import ChatTemplate

    if loaded.tokenizer_dir is None:
        return None
    try:
        return ChatTemplate(loaded.tokenizer_dir)
    except ValueError as e:
        print(f"gdnx {command}: no chat template: {e}", file=sys.stderr)
        return None


def eos_ids(loaded: Loaded, chat: Any = None) -> list[int]:
    """The model config's end-of-sequence ids (else a run's end of
    document), and the chat template's eos token (a chat model's end of
    turn, e.g. <|im_end|>)."""
    eos = loaded.model.config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if loaded.document_eos is not None:
        ids.append(loaded.document_eos)
    if (found := _chat_eos(loaded, chat)) is not None:
        ids.append(found)
    return sorted(set(ids))


def _chat_eos(loaded: Loaded, chat: Any) -> int | None:
    """The chat template's eos token's id (its end of turn), if any."""
    name = chat.special.get("eos_token") if chat is not None else None
    found = loaded.tokenizer.token_id(name) if name is not None else None
    return None if found is None else int(found)


def speculation(value: str, model_config: Any = None) -> dict[str, Any]:
    """--speculative's value as EngineConfig fields: K (n-gram drafts, 0:
    off), ngram:K, mtp (one draft per layer of the model's multi-token
    prediction module) or mtp:K (K drafts, its first layer chained). A
    refusal is a ConfigError naming the flag; without the model's config,
    only the value's form is checked (before a checkpoint loads)."""
    method, _, count = value.partition(":")
    if not count and method.isdigit():
        method, count = "ngram", method
    if method not in ("ngram", "mtp") or (count and not count.isdigit()) or (method == "ngram" and not count):
        raise ConfigError(f"--speculative: expected K (n-gram drafts, 0: off), ngram:K, mtp or mtp:K, got {value!r}")
    if model_config is None:
        return {}
    depth = model_config.mtp_num_layers
    if method == "mtp" and not depth:
        raise ConfigError("--speculative: mtp drafts with the model's multi-token prediction module, and this model "
                          "has none (its checkpoint holds none of the module's weights; model.mtp_num_layers=0)")
    tokens = int(count) if count else depth
    if method == "mtp" and tokens < 1:
        raise ConfigError(f"--speculative: mtp:K drafts K >= 1 tokens, got {value!r}")
    return {"draft_method": method, "draft_tokens": tokens}


def engine_config(**fields: Any) -> Any:
    """An EngineConfig from a command's flags; a refused value is a
    ConfigError naming its flag."""
    from gdnx.serving.config import EngineConfig

    try:
        for name in ("draft_tokens", "prefix_cache_bytes"):
            if fields.get(name, 0) < 0:  # the flag's own value (MiB for the prefix cache) is what was wrong
                raise FieldError(name, "expected a non-negative integer")
        return EngineConfig(**fields)
    except FieldError as e:
        raise flag_error(e) from None


def build_engine(loaded: Loaded, settings: Any, chat: Any = None) -> Any:
    """The Engine for a loaded model and an EngineConfig. A refused setting
    is a ConfigError naming its flag."""
    from gdnx.serving import Engine
    from gdnx.serving.grammar import Grammars

    if settings.max_length > loaded.max_positions:
        raise ConfigError(f"--max-length: {settings.max_length} exceeds the model's {loaded.max_positions} positions "
                          "(max_position_embeddings)")
    try:
        eos = eos_ids(loaded, chat)
        tok = getattr(loaded.tokenizer, "tok", None)  # a tokenizer.json's: structured outputs follow its vocabulary
        # a constrained output ends with the chat template's end of turn when there is one, else the config's eos
        end = _chat_eos(loaded, chat)
        grammars = Grammars(tok.to_str(), loaded.model.config.vocab_size, end if end is not None else eos[0]) \
            if tok is not None and eos else None
        return Engine(loaded.model, settings, tokenizer=loaded.tokenizer, eos_token_ids=eos, mesh=loaded.mesh,
                      grammars=grammars)
    except FieldError as e:
        raise flag_error(e) from None


def flag_error(e: FieldError) -> ConfigError:
    """An engine field's refusal as the flag a user typed (fields named in
    its detail too)."""
    flag = ENGINE_FLAGS.get(e.field, e.field)
    detail = e.detail
    for field, other in ENGINE_FLAGS.items():
        detail = re.sub(rf"\b{field}=", f"{other}=", detail)
    return ConfigError(f"{flag}: {detail}")
