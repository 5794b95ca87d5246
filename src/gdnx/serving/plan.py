"""`gdnx plan --serve`: compile the serving engine's programs for a TPU
slice (or the GPUs of one host) from this host, as `gdnx plan` compiles a
train step.

The model is built abstractly (shapes only), its weights placed on the
slice's mesh by the sharding rules, the engine's slot state laid out as
the engine lays it out (gdnx.serving.programs.place), and the programs a
server runs at its largest shapes are compiled deviceless (libtpu, or the
CUDA plugin for GPUs): the
prefill of max_slots prompts in the longest bucket (what a burst of long
prompts costs: the engine prefills up to max_slots prompts of one bucket
together), the decode step over every slot, and with speculation the
verify pass. The bytes a chip holds are its share of the weights, its
share of the slot state (the cache of every slot at the engine's
capacity, the sampling state) and the largest program's temporaries.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gdnx.config.schema import Config
from gdnx.models import CausalLM
from gdnx.models.causal_lm import for_target
from gdnx.models.cache import row_axes
from gdnx.parallel import as_auto, make_mesh, shardings
from gdnx.aot import (Buffer, abstract, compile_reporting, compile_within, describe_buffers, target_devices,
                      targeting, xla_flops)
from gdnx.serving import programs
from gdnx.serving.config import EngineConfig
from gdnx.serving.runner import DecodeBatch, PrefillBatch, VerifyBatch, lower, new_slots
from gdnx.measure import stored_bytes
from gdnx.stacking import layer_ndim

PROGRAMS = ("prefill", "decode", "verify")


@dataclasses.dataclass(frozen=True)
class ServePlan:
    topology: str
    chips: int
    mesh: dict[str, int]
    parameters: int
    max_slots: int
    max_length: int
    max_prefill_batch: int
    prefill_follows_slots: bool   # max_prefill_batch is max_slots, not set apart
    prefix_cache: bool            # the prefill also returns the states at block ends (the prefix cache's)
    capacity: int                 # tokens each slot's cache holds (max_length in blocks, plus drafts)
    speculative: int              # draft tokens per verify pass
    drafter: str                  # who drafts them (EngineConfig.draft_method)
    weight_bytes: int             # per chip
    slot_bytes: int               # per chip: every slot's cache and sampling state
    temp_bytes: dict[str, int]    # per chip, per program
    compile_s: dict[str, float]
    xla_flops: dict[str, float]   # XLA's cost analysis per chip (a loop's body counted once)
    decode_flops: float           # one decode step over every slot at full length, by the architecture
    hbm_bytes: int
    kernel_calls: int             # Mosaic or Triton kernels (the delta rule's) in the compiled prefill
    largest: dict[str, list[Buffer]]  # per program: its largest temporaries (XLA's buffer assignment)

    @property
    def peak_bytes(self) -> int:
        """Weights, slot state and the largest program's temporaries (the
        slot state is donated to each program: updated in place)."""
        return self.weight_bytes + self.slot_bytes + max(self.temp_bytes.values())

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes

    @property
    def largest_slots(self) -> int:
        """The most slots that fit at this length (an estimate): the slot
        state and the decode and verify programs' temporaries grow in
        proportion to the slots, the prefill's in proportion to its rows
        (the slots too, unless max_prefill_batch is set apart)."""
        room = self.hbm_bytes - self.weight_bytes
        per_slot = self.slot_bytes / self.max_slots
        stepping = max(v for k, v in self.temp_bytes.items() if k != "prefill") / self.max_slots
        prefill = self.temp_bytes["prefill"]
        if self.prefill_follows_slots:
            return max(0, int(room // (per_slot + max(stepping, prefill / self.max_slots))))
        return max(0, int(min((room - prefill) // per_slot, room // (per_slot + stepping))))


def decode_flops(cfg: Any, params: Any, slots: int, length: int) -> float:
    """FLOPs of one decode step (one token for each of `slots` rows whose
    caches hold `length` tokens): 2 per matmul parameter a token uses (the
    routed experts' top-k share), attention's scores and weighted sum over
    the keys a token reads (4 per head dim per key; a sliding window's or
    the whole length), the delta rule's state update and read-out per value
    head (6 K V)."""
    flat = [("/".join(map(str, path)), math.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(params)
            if layer_ndim(path, len(x.shape)) >= 2]
    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    matmul = sum(n * (share if "experts_" in name else 1.0) for name, n in flat
                 if "embed_tokens" not in name and "conv_weight" not in name)
    if cfg.tie_word_embeddings:
        matmul += cfg.vocab_size * cfg.hidden_size
    kinds = cfg.resolved_layer_types
    head = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2 if cfg.attention_kind == "latent" \
        else cfg.head_dim
    window = min(cfg.sliding_window or length, length)
    attention = 4 * cfg.num_attention_heads * head * (kinds.count("full_attention") * length
                                                       + kinds.count("sliding_attention") * window)
    delta = 6 * kinds.count("linear_attention") * cfg.linear_num_value_heads * cfg.linear_key_head_dim \
        * cfg.linear_value_head_dim
    return float(slots * (2 * matmul + attention + delta))


def _per_chip(tree: Any) -> int:
    """Bytes of one chip's share of abstract arrays with shardings (the largest shard)."""
    return sum(stored_bytes(x.sharding.shard_shape(x.shape), x.dtype) for x in jax.tree.leaves(tree))


def _refusal(what: str, topology: str) -> str:
    return (f"{topology}: the {what} does NOT fit ({{}}); lower --max-slots, --max-prefill-batch or --max-length, "
            "or shard over more chips (parallel.tensor)")


def serve_plan(config: Config, topology: str, engine: EngineConfig, *, prefix_cache: bool = True,
               logprobs: int = 0) -> ServePlan:
    """Compile the engine's prefill, decode and verify programs for
    `topology` (a TPU slice, or NAME:N GPUs) with config's model and parallel
    sections and the engine's settings (`engine`: max_slots, max_length,
    max_prefill_batch, decode_steps, draft_tokens, block_size), the very
    programs and batch shapes an Engine runs (runner.py's batches).
    prefix_cache: the prefill keeps the states at block ends, as an engine
    with a prefix cache has it do; logprobs: the top-N computed per token."""
    devices, hbm, kind = target_devices(topology)
    cfg = config.model
    if engine.max_length > cfg.max_position_embeddings:
        raise ValueError(f"--max-length: {engine.max_length} exceeds the model's {cfg.max_position_embeddings} "
                         "positions (max_position_embeddings)")
    cfg = for_target(cfg, kind)
    if config.parallel.context != 1:
        raise ValueError(f"parallel.context: the engine splits heads and slots, not sequences: expected 1, got "
                         f"{config.parallel.context}")
    mesh = as_auto(make_mesh(config.parallel, devices))  # as the engine runs it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "kernel on CPU": compiled for TPU here, not run
        model = nnx.eval_shape(lambda: CausalLM(cfg))
    graphdef, state = nnx.split(model)
    s, pr, k = engine.max_slots, engine.prefill_rows, engine.draft_tokens
    mtp = k if engine.draft_method == "mtp" else 0
    if mtp and not cfg.mtp_num_layers:
        raise ValueError("--speculative: mtp drafts with the multi-token prediction module, which this model has "
                         "none of (model.mtp_num_layers=0)")
    flops = decode_flops(cfg, nnx.state(model, nnx.Param), s, engine.max_length)
    state = abstract(state, shardings(state, cfg, mesh))
    shapes = engine.shapes(cfg)
    static = programs.Static(graphdef, cfg, row_axes(model), (), logprobs, False, mtp,
                             engine.drafting_rows(devices[0].platform))
    compiled_programs = programs.compile_programs(static)
    replicated = NamedSharding(mesh, PartitionSpec())

    def host(x):  # an input the engine sends from the host (whole on every chip)
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated)

    batches: dict[str, PrefillBatch | DecodeBatch | VerifyBatch] = {
        "prefill": PrefillBatch.idle(pr, shapes.padded_length, max_slots=s, vocab=cfg.vocab_size),
        "decode": DecodeBatch.idle(s, max_slots=s, steps=engine.decode_steps, vocab=cfg.vocab_size),
        # the largest verify pass: at the most decode rows that still draft
        "verify": VerifyBatch.idle(max([r for r in shapes.decode_rows if r <= engine.drafting_rows(
            devices[0].platform)] or [1]), max_slots=s, draft=k)}
    history = shapes.history_every(shapes.padded_length, prefix_cache)
    compile_s: dict[str, float] = {}
    temp: dict[str, int] = {}
    largest: dict[str, list[Buffer]] = {}
    cost: dict[str, float] = {}
    kernels = 0
    with jax.set_mesh(mesh), targeting(devices[0]):
        make = jax.jit(lambda: new_slots(static, model, engine, shapes, k))
        slot_shapes = jax.eval_shape(make)
        slots = abstract(slot_shapes, compile_within(make.lower(), _refusal("slot state", topology)).output_shardings)
        for name in PROGRAMS:
            if name == "verify" and not k:
                continue
            t0 = time.perf_counter()
            lowered = lower(compiled_programs, state, slots, batches[name], history, host)
            compiled, largest[name] = compile_reporting(lowered, _refusal(f"{name} program", topology))
            compile_s[name] = time.perf_counter() - t0
            memory = compiled.memory_analysis()
            assert memory is not None  # TPU executables report it
            temp[name] = int(memory.temp_size_in_bytes)
            cost[name] = xla_flops(compiled)
            if name == "prefill":
                text = compiled.as_text() or ""
                kernels = text.count("tpu_custom_call") + text.count("__gpu$xla.gpu.triton")
    return ServePlan(topology, len(devices), dict(mesh.shape),
                     sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))), s,
                     engine.max_length, pr, engine.max_prefill_batch is None and pr == s, prefix_cache, shapes.capacity,
                     k, engine.draft_method,
                     _per_chip(state), _per_chip(slots), temp, compile_s, cost, flops, hbm, kernels, largest)


def describe(p: ServePlan) -> str:
    gib = lambda n: f"{n / 2 ** 30:,.2f} GiB"  # noqa: E731
    axes = " x ".join(f"{k}={v}" for k, v in p.mesh.items())
    verdict = "fits" if p.fits else "does NOT fit"
    temps = ", ".join(f"{name} {gib(n)}" for name, n in p.temp_bytes.items())
    times = ", ".join(f"{name} {t:.1f} s" for name, t in p.compile_s.items())
    return "\n".join([
        f"{p.topology}: {p.chips} chips, mesh {axes}; {p.parameters / 1e9:,.2f}B parameters; {p.max_slots} slots of "
        f"{p.max_length} tokens (a cache of {p.capacity} each), prefills of {p.max_prefill_batch} prompts"
        f"{' with the prefix cache' if p.prefix_cache else ''}"
        f"{f', {p.speculative} draft tokens ({p.drafter})' if p.speculative else ''}",
        f"per chip: weights {gib(p.weight_bytes)}, slot state {gib(p.slot_bytes)} "
        f"({gib(p.slot_bytes / p.max_slots)} per slot), temporaries {temps}",
        f"peak per chip {gib(p.peak_bytes)} of {gib(p.hbm_bytes)} HBM: {verdict}; at {p.max_length} tokens about "
        f"{p.largest_slots} slots fit",
        f"compiled in {times} ({p.kernel_calls} Pallas kernel calls in the prefill)",
        *(f"largest temporaries, {name}: {describe_buffers(buffers)}" for name, buffers in p.largest.items()),
        f"FLOPs per decode step: {p.decode_flops:.3e} by the architecture ({p.max_slots} tokens at full length; "
        f"{p.decode_flops / p.chips:.3e} per chip); XLA's cost analysis of the decode program "
        + (f"{p.xla_flops['decode']:.3e} per chip (its loops' bodies counted once)" if p.xla_flops["decode"]
           else "not reported for this target"),
    ])
