"""`gdnx plan`: compile one training step for a TPU slice from this host.

libtpu compiles for a topology that need not be attached (deviceless
ahead-of-time compilation). The model is built abstractly (shapes only, no
memory), its parameters and AdamW state are placed on the slice's mesh by
the sharding rules, and the whole train step (the Pallas TPU kernel
compiled, not interpreted; a host-fed batch of packed rows) is compiled for
the slice. The compiled program's memory analysis gives the bytes each chip
holds; its cost analysis the FLOPs. Needs `jax[tpu]` (libtpu) at the
project's jax version.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from gdnx.aot import Buffer, abstract, compile_reporting, describe_buffers, target_devices, targeting, xla_flops
from gdnx.config.schema import Config
from gdnx.data.source import Batch
from gdnx.models import CausalLM
from gdnx.models.adapters import adapter_spec
from gdnx.models.causal_lm import for_target
from gdnx.parallel import make_mesh, shardings, spec
from gdnx.rl.objective import Scored
from gdnx.rl.replay import ReplayBatch
from gdnx.scales import SUFFIX
from gdnx.serving.plan import ServePlan
from gdnx.stacking import layer_ndim
from gdnx.training.rl import BitwiseRows, Rows, replay_shapes, rl_programs
from gdnx.training.step import check_trainable, make_optimizer, make_step_fn



@dataclasses.dataclass(frozen=True)
class Plan:
    topology: str
    chips: int
    mesh: dict[str, int]
    parameters: int
    argument_bytes: int     # per chip: parameters, optimizer state, batch
    temp_bytes: int         # per chip: activations and everything else the step makes
    output_bytes: int       # per chip: new parameters and optimizer state (donated: they reuse the arguments')
    alias_bytes: int        # outputs written in place of donated arguments
    hbm_bytes: int          # per chip
    compile_s: float
    flops: float            # XLA's cost analysis of the per-chip program (a loop's body counted once)
    model_flops: float      # the step's arithmetic, counted from the architecture (all chips)
    kernel_calls: int       # Pallas kernels (Mosaic TPU, Triton) in the compiled program
    largest: list[Buffer]   # its largest temporaries (XLA's buffer assignment)

    @property
    def peak_bytes(self) -> int:
        """What a chip holds at once: arguments, temporaries and the outputs
        that do not reuse a donated argument."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes


def model_flops(config: Config, params: Any) -> float:
    """Training FLOPs of one step from the architecture: 6 per matmul
    parameter a token uses (forward 2, backward 4; the routed experts'
    top-k share), causal attention's scores and weighted sum (12 per head
    dim per key attended, half the row on average or what a sliding window
    holds; latent attention's head dim is the mean of its score and value
    widths), and the GDN state work per value head (chunked form: read-out,
    update and the W S product, 6 K V, plus the intra-chunk products,
    2 C (K + V), and for KDA the per-channel decays' masked products, 8 C K
    per bit of the chunk position, times 3 for the backward). Recomputation
    under remat is not counted (model FLOPs, as MFU counts them). params: the model's parameters (arrays or shapes)."""
    m = config.model
    tokens = config.train.batch_size * config.data.seq_len
    flat = [("/".join(map(str, path)), math.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(params)
            if layer_ndim(path, len(x.shape)) >= 2]
    share = m.num_experts_per_tok / m.num_experts if m.num_experts else 1.0
    matmul = sum(n * (share if "experts_" in name else 1.0) for name, n in flat if "embed_tokens" not in name
                 and "conv_weight" not in name and f"{SUFFIX}'" not in name)
    if m.tie_word_embeddings:
        matmul += m.vocab_size * m.hidden_size  # the LM head is the embedding table
    kinds, seq = m.resolved_layer_types, config.data.seq_len
    # keys a query attends on average: half the row, or within a sliding window
    window = m.sliding_window or seq
    seen = (min(window, seq) * (min(window, seq) + 1) / 2 + max(seq - window, 0) * window) / seq
    head = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2 if m.attention_kind == "latent" \
        else m.head_dim
    attention = 12 * m.num_attention_heads * head * (kinds.count("full_attention") * seq / 2
                                                      + kinds.count("sliding_attention") * seen)
    k, v, c = m.linear_key_head_dim, m.linear_value_head_dim, m.gdn_chunk_size
    per_head = 6 * k * v + 2 * c * (k + v)
    if m.linear_kind == "kda":  # the per-channel decays: 8 C K per bit of the chunk position
        per_head += 8 * max(1, (c - 1).bit_length()) * c * k
    gdn = 3 * kinds.count("linear_attention") * m.linear_num_value_heads * per_head
    return float(tokens * (6 * matmul + attention + gdn))


def rl_batch(config: Config, rows: NamedSharding, whole: NamedSharding) -> tuple[Any, Scored]:
    """A rollout's completions as the update reads them (abstract): rows of
    prompt + completion and their scores; bitwise, also the engine's
    prefill blocks (the longest prompt's count) and the drawn tokens, whole
    on every chip as the trainer places them."""
    rl = config.train.rl
    assert rl is not None
    b, t, new = config.train.batch_size, config.data.seq_len, rl.max_new_tokens

    def array(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if not rl.bitwise:
        tokens: Any = Rows(array((b, t), jnp.int32, rows), array((b, t), jnp.int32, rows))
        width, placed = t, rows
    else:
        shapes = replay_shapes(config)
        block, slots = shapes.block, shapes.slots
        blocks = -(-(t + 1 - new) // block)  # the longest prompt a run admits
        replay = ReplayBatch(array((slots, blocks, block), jnp.int32, whole), array((slots, blocks), jnp.int32, whole),
                             array((slots, new), jnp.int32, whole))
        tokens = BitwiseRows(replay, Rows(array((b, t), jnp.int32, whole), array((b, t), jnp.int32, whole)),
                             array((b, new), jnp.int32, whole))
        width, placed = new, whole
    flags, floats = array((b, width), jnp.bool_, placed), array((b, width), jnp.float32, placed)
    return tokens, Scored(flags, floats, floats, floats, floats, flags)


def plan(config: Config, topology: str) -> Plan:
    """Compile config's train step for `topology`: a TPU slice (v5p:2x2x1)
    or N GPUs of one host (h200:8); with train.rl, the RL update on a
    rollout's completions."""
    check_trainable(config)
    devices, hbm, kind = target_devices(topology)
    model_cfg = for_target(config.model, kind)
    config = config.model_copy(update={"model": model_cfg})
    mesh = make_mesh(config.parallel, devices)
    adapters = adapter_spec(config.train.lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "kernel on CPU": compiled for TPU here, not run
        model = nnx.eval_shape(lambda: CausalLM(model_cfg, adapters=adapters))
    frozen = None
    if adapters is None:
        graphdef, params = nnx.split(model, nnx.Param)
        arithmetic = model_flops(config, params)
    else:  # LoRA: the adapters train, the base (quantized or not) is given frozen
        graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, nnx.Param)  # type: ignore[misc]
        arithmetic = model_flops(config, frozen)
        frozen = abstract(frozen, shardings(frozen, model_cfg, mesh))
    params = abstract(params, shardings(params, model_cfg, mesh))
    tx = make_optimizer(config.train)
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = abstract(opt_state, shardings(opt_state, model_cfg, mesh))
    b, t = config.train.batch_size, config.data.seq_len
    rows = NamedSharding(mesh, spec(("batch", "length"), (b, t), mesh=mesh))
    ints = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows)
    flags = jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=rows)
    scalar = NamedSharding(mesh, jax.sharding.PartitionSpec())
    if config.train.rl is None:
        # packed rows, as the host loader gives them (abstract: shapes and placements)
        batch = Batch(*(cast(jax.Array, x) for x in (ints, ints, flags, flags, ints)))
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)
        step_fn = jax.jit(make_step_fn(config, graphdef, tx), donate_argnums=(0, 1))
        args: tuple = (params, opt_state, step, batch, frozen)
    else:  # the RL update on a rollout's completions, laid out as the trainer lays them out
        _, update = rl_programs(config, graphdef, tx, replay_shapes(config))
        step_fn = jax.jit(update, donate_argnums=(0, 1))
        tokens, scored = rl_batch(config, rows, scalar)
        args = (params, opt_state, tokens, scored, jax.ShapeDtypeStruct((), jnp.bool_, sharding=scalar), frozen)
    t0 = time.perf_counter()
    # the kernels take the slice's tiles (tiles.py), not this host's
    with jax.set_mesh(mesh), targeting(devices[0]):
        compiled, largest = compile_reporting(step_fn.lower(*args),
                                              f"{topology}: does NOT fit ({{}}); shard over more chips (parallel.fsdp), "
                                              "raise train.grad_accum_steps or set model.remat_policy=full")
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    assert memory is not None  # TPU and GPU executables report it
    return Plan(topology, len(devices), dict(mesh.shape),
                sum(math.prod(x.shape) for x in jax.tree.leaves((params, frozen)) if x is not None),
                memory.argument_size_in_bytes, memory.temp_size_in_bytes, memory.output_size_in_bytes,
                memory.alias_size_in_bytes, hbm, compile_s, xla_flops(compiled),
                arithmetic, _kernel_calls(compiled.as_text() or ""), largest)


def _kernel_calls(text: str) -> int:
    """Pallas kernel calls in a compiled program (Mosaic TPU custom calls, Triton fusions)."""
    return text.count("tpu_custom_call") + text.count("__gpu$xla.gpu.triton")


def describe(p: Plan) -> str:
    gib = lambda n: f"{n / 2 ** 30:,.2f} GiB"  # noqa: E731
    axes = " x ".join(f"{k}={v}" for k, v in p.mesh.items())
    verdict = "fits" if p.fits else "does NOT fit"
    return "\n".join([
        f"{p.topology}: {p.chips} chips, mesh {axes}; {p.parameters / 1e9:,.2f}B parameters",
        f"per chip: arguments {gib(p.argument_bytes)}, temporaries {gib(p.temp_bytes)}, outputs "
        f"{gib(p.output_bytes)} ({gib(p.alias_bytes)} in place of donated arguments)",
        f"peak per chip {gib(p.peak_bytes)} of {gib(p.hbm_bytes)} HBM: {verdict}",
        f"compiled in {p.compile_s:.1f} s ({p.kernel_calls} Pallas kernel calls)",
        f"largest temporaries: {describe_buffers(p.largest)}",
        f"FLOPs per step: {p.model_flops:.3e} by the architecture ({p.model_flops / p.chips:.3e} per chip); XLA's "
        + (f"cost analysis {p.flops:.3e} per chip (it counts a loop's body once: the scanned layers' and the "
           "blocked loss's)" if p.flops else "cost analysis not reported for this target"),
    ])


def describe_rl(p: Plan, rollout: ServePlan) -> str:
    """An RL run's two phases on a chip: the rollout engine reads the
    trainer's weights (no copy) and keeps its slot state through the
    update; while it draws, the trainer's arguments (weights, optimizer
    state) stay where they are."""
    gib = lambda n: f"{n / 2 ** 30:,.2f} GiB"  # noqa: E731
    engine_temp = max(rollout.temp_bytes.values())
    update = p.peak_bytes + rollout.slot_bytes
    drawing = p.argument_bytes + rollout.slot_bytes + engine_temp
    peak = max(update, drawing)
    return "\n".join([
        f"rollout engine (train.rl): {rollout.max_slots} slots of {rollout.max_length} tokens; per chip: slot state "
        f"{gib(rollout.slot_bytes)}, its programs' temporaries up to {gib(engine_temp)}; compiled in "
        f"{sum(rollout.compile_s.values()):.1f} s",
        f"RL run per chip: updating {gib(update)} (the step above and the slot state), drawing {gib(drawing)} "
        f"(the step's arguments, the slot state and the engine's temporaries); peak {gib(peak)} of "
        f"{gib(p.hbm_bytes)} HBM: {'fits' if peak <= p.hbm_bytes else 'does NOT fit'}",
    ])
