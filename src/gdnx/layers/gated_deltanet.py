"""The Gated DeltaNet layer of every GDN hybrid gdnx builds.

The input projections are fused, in Qwen3-Next's per-key-head interleaved
layout (for key head i: in_proj_qkvz [q_i | k_i | v of its G value heads | z
of them], in_proj_ba [b of its G value heads | a of them]), so a key head's
group stays contiguous for tensor sharding. Qwen3-Next's checkpoints store
exactly this; Qwen3.5's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and
OLMo Hybrid's (q/k/v/g/b/a_proj) are regrouped into it on loading
(gdnx.checkpoints.hf_names). Then a depthwise causal conv + SiLU over q, k,
v (its own op; channels taken per key head, the conv weight regrouped to
match), beta = sigmoid(b) (2 sigmoid(b) with allow_neg_eigval),
g = -exp(A_log) * softplus(a + dt_bias) in float32, the delta rule with
l2-normalised q and k, a gated RMSNorm with z, and out_proj. On a mesh the
conv and the delta rule run under shard_map (gdnx.parallel.gdn).
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.documents import document_starts
from gdnx.layers.linear import linear
from gdnx.ops import causal_conv1d, chunk_gated_delta_rule, gated_rmsnorm, recurrent_gated_delta_rule
from gdnx.ops.causal_conv1d import cross_document_terms
from gdnx.ops.delta_rule.decode_step import StateStack, decode_step
from gdnx.ops.delta_rule.options import DeltaRuleOptions
from gdnx.ops.delta_rule.tiles import target_platform
from gdnx.parallel.context import context_causal_conv1d, context_cross_document_terms, context_delta_rule
from gdnx.parallel.gdn import GATE, OUT, run_gdn_core
from gdnx.parallel.rules import HIDDEN, constrain, current_mesh, out_sharding, spec


# The gate at a document's first token in a packed row: exp(RESET_GATE) is 0
# in float32, so the state carried in from the previous document is dropped.
# The op forms every decay from sums of gates of one sign (its chunk algebra), so
# this value costs no precision to the gates around it.
RESET_GATE = -1e4


class DeltaRuleHistory(NamedTuple):
    """The states after every `every` tokens of one call (what a prefix cache
    keeps at block ends, and what speculative decoding selects from):
    conv [B, NS, conv_dim, kernel_size - 1], recurrent [B, NS, HV, K, V],
    entry j after token (j + 1) * every - 1; on a layer with a per-layer
    embedding, its states likewise (DeltaRuleState's ple_*, [B, NS, ...])."""
    conv: jax.Array
    recurrent: jax.Array
    ple_conv: jax.Array | None = None
    ple_context: jax.Array | None = None


class DeltaRuleState(NamedTuple):
    """conv [B, conv_dim, kernel_size - 1] (oldest first), recurrent [B, HV, K, V];
    history: the states along the last call when it asked for them.
    A Qwen4-Exp layer with a per-layer embedding (gdnx.layers.per_layer_embedding)
    carries its state in the same entry, so that generation, the prefix
    cache and speculative rollback keep it with the mixer's: ple_conv
    [B, state_length, N*H], its convolution's last inputs, and ple_context
    [B, ngram_size - 1], the last tokens, each + 1 (0: before the sequence's
    start, so that a zero state is a fresh one); None elsewhere."""
    conv: jax.Array
    recurrent: jax.Array | StateStack
    history: DeltaRuleHistory | None = None
    ple_conv: jax.Array | None = None
    ple_context: jax.Array | None = None


def conv_windows(inputs: jax.Array, ends: jax.Array, hist: int) -> jax.Array:
    """Conv states taken from the inputs: inputs [B, hist + T, C] (the
    incoming state's hist = kernel_size - 1 inputs, then the call's T),
    ends int [B, N] -> [B, N, C, hist]: entry n holds the hist inputs before
    token ends[:, n] of the call, oldest first."""
    index = ends[..., None] + jnp.arange(hist, dtype=ends.dtype)             # [B, N, hist]
    rows = jnp.take_along_axis(inputs[:, None], index[..., None], axis=2)   # [B, N, hist, C]
    return jnp.swapaxes(rows, -1, -2)


def _per_token(mask: jax.Array, g: jax.Array) -> jax.Array:
    """A [B, T] mask shaped to broadcast against a gate [B, T, HV] or [B, T, HV, K]."""
    return mask.reshape(mask.shape + (1,) * (g.ndim - 2))


class DeltaRuleMixer(nnx.Module):
    """What the delta-rule mixers share: the states, the causal conv over
    q, k, v and the delta rule on channels grouped per key head, on one
    device or a mesh, with the serving paths (padded rows, state
    histories). A subclass sets hk, hv, dk, dv, width, conv_dim, op, and
    conv_weight [conv_dim, width] in Hugging Face's [q | k | v] order, and
    names its delta-rule ops (chunk_op, recurrent_op: the gated delta rule's
    here, KDA's in KimiDeltaAttention)."""

    # staticmethod: plain functions, not bound to the module
    chunk_op = staticmethod(chunk_gated_delta_rule)
    recurrent_op = staticmethod(recurrent_gated_delta_rule)

    hk: int
    hv: int
    dk: int
    dv: int
    width: int
    conv_dim: int
    op: DeltaRuleOptions
    conv_weight: nnx.Param

    def zero_state(self, batch: int, dtype: DTypeLike) -> DeltaRuleState:
        return DeltaRuleState(jnp.zeros((batch, self.conv_dim, self.width - 1), dtype),
                        jnp.zeros((batch, self.hv, self.dk, self.dv), self.op.state_dtype))

    def _group_channels(self, a, axis: int):
        """Conv channels along `axis` from Hugging Face's [q | k | v] order to
        [HK, dk + dk + G dv] (per key head: its q, its k, its value heads'
        v), so that a key head's channels stay together on a tensor shard."""
        a = jnp.moveaxis(a, axis, -1)
        kd, lead = self.hk * self.dk, a.shape[:-1]
        parts = (a[..., :kd].reshape(*lead, self.hk, self.dk), a[..., kd:2 * kd].reshape(*lead, self.hk, self.dk),
                 a[..., 2 * kd:].reshape(*lead, self.hk, -1))
        return jnp.moveaxis(jnp.concatenate(parts, axis=-1), (-2, -1), (axis, axis + 1))

    def _ungroup_channels(self, a, axis: int):
        a = jnp.moveaxis(a, (axis, axis + 1), (-2, -1))
        lead = a.shape[:-2]
        parts = (a[..., :self.dk], a[..., self.dk:2 * self.dk], a[..., 2 * self.dk:])
        return jnp.moveaxis(jnp.concatenate([x.reshape(*lead, -1) for x in parts], axis=-1), -1, axis)

    def _core(self, mixed, conv_weight, g, beta, conv_state, state, context_axis, starts=None, lengths=None,
              history_every=None):
        """conv + delta rule on one shard: mixed [B, T, HK, dk + dk + G dv]
        (this shard's key heads), conv_weight [HK, ., W], g [B, T, HV] (GDN)
        or [B, T, HV, K] (KDA) and beta [B, T, HV], states grouped likewise or None, starts [B, T] (packed
        documents' first tokens) or None. The sequence is split over
        `context_axis` when one is given. lengths [B]: the tokens of each row
        past it are padding (g and beta already 0 there), and the conv state
        is the window before it. history_every: also return the states
        after every that many tokens (DeltaRuleHistory, grouped channels)."""
        b, t, hk, width = mixed.shape
        flat, w = mixed.reshape(b, t, hk * width), conv_weight.reshape(hk * width, self.width)
        conv0 = None if conv_state is None else conv_state.reshape(b, hk * width, self.width - 1)
        keep = state is not None
        # a decode step updates the state where it lies (a scanned cycle's stack, or the slot's own array);
        # every other call steps this layer's entry of a stack and writes it back
        decoding = keep and t == 1 and history_every is None
        stack = state if isinstance(state, StateStack) else None
        if stack is not None and not decoding:
            state = jax.lax.dynamic_index_in_dim(stack.stack, stack.layer, 0, keepdims=False)
        # packed documents: the activation waits until the window terms from
        # before each document's start are taken out
        activation = "silu" if starts is None else None
        if context_axis:
            y, conv1 = context_causal_conv1d(flat, w, axis=context_axis, initial_state=conv0, output_final_state=keep,
                                             activation=activation)
        else:
            y, conv1 = causal_conv1d(flat, w, initial_state=conv0, output_final_state=keep, activation=activation)
        if starts is not None:
            terms = (context_cross_document_terms(flat, w, starts, axis=context_axis) if context_axis
                     else cross_document_terms(flat, w, starts))
            y = jax.nn.silu(y - terms)
        y = y.reshape(b, t, hk, width)
        q, k = y[..., :self.dk], y[..., self.dk:2 * self.dk]
        v = y[..., 2 * self.dk:].reshape(b, t, -1, self.dv)
        common = dict(initial_state=state, output_final_state=keep, use_qk_l2norm=True)
        chunk, recurrent = self.chunk_op, self.recurrent_op
        history = None
        if decoding and (stack is not None or self._step_kernel()):
            states = stack if stack is not None else StateStack(state[None], jnp.int32(0))
            o, states = decode_step(q, k, v, g, beta, states, use_qk_l2norm=True, decay_dtype=self.op.decay_dtype,
                                    kernel=self._step_kernel(), interpret=self.op.interpret)
            rec = states if stack is not None else states.stack[0]
        elif keep and (t == 1 or history_every == 1):
            o, rec, *tokens = recurrent(q, k, v, g, beta, **common, **self.op.recurrent_kwargs(),
                                        output_token_states=history_every == 1)
            history = tokens[0] if tokens else None
        elif context_axis:
            o, rec = context_delta_rule(chunk, q, k, v, g, beta, axis=context_axis, **common,
                                        **self.op.chunk_kwargs())
        else:
            o, rec, *chunks = chunk(q, k, v, g, beta, **common, options=self.op,
                                    output_chunk_states=history_every is not None)
            if chunks:  # every history_every-th chunk end (a multiple of the chunk size)
                step = history_every // self.op.chunk_size
                history = chunks[0][:, step - 1:(t // history_every) * step:step]
        if stack is not None and not decoding:
            rec = StateStack(jax.lax.dynamic_update_index_in_dim(stack.stack, rec.astype(stack.stack.dtype),
                                                                  stack.layer, 0), stack.layer)
        if conv1 is not None and (lengths is not None or history is not None):
            # conv states from the inputs: before each row's first padding token, and at every snapshot
            hist = self.width - 1
            seen = jnp.concatenate([jnp.swapaxes(conv0, 1, 2) if conv0 is not None
                                    else jnp.zeros((b, hist, hk * width), flat.dtype), flat], axis=1)
            if lengths is not None:
                conv1 = conv_windows(seen, lengths[:, None], hist)[:, 0].astype(conv1.dtype)
            if history is not None:
                ends = jnp.arange(1, history.shape[1] + 1, dtype=jnp.int32) * history_every
                windows = conv_windows(seen, jnp.broadcast_to(ends, (b, ends.shape[0])), hist)
                history = DeltaRuleHistory(windows.reshape(b, -1, hk, width, hist).astype(conv1.dtype), history)
        return o, None if conv1 is None else conv1.reshape(b, hk, width, self.width - 1), rec, history

    def _step_kernel(self) -> bool:
        """Whether a decode step runs the TPU kernel (the op's pallas_tpu,
        named or chosen on a TPU) rather than the token recurrence."""
        name = self.op.implementation
        return name == "pallas_tpu" or (name is None and target_platform() == "tpu")

    def _run(self, mixed: jax.Array, g: jax.Array, beta: jax.Array, state: DeltaRuleState | None,
             segments: jax.Array | None, lengths: jax.Array | None, history_every: int | None):
        """The conv and the delta rule from the projections: mixed
        [B, T, HK, dk + dk + G dv] (q, k, v grouped per key head), g and
        beta as _core takes them; the arguments after them as __call__'s.
        Returns (o [B, T, HV, V], conv state, recurrent state, history)."""
        t = mixed.shape[1]
        starts = None
        if segments is not None:
            starts = document_starts(segments)
            g = jnp.where(_per_token(starts, g), RESET_GATE, g)
        core = self._core
        if lengths is not None or history_every is not None:
            if state is None:
                raise ValueError("lengths, history_every: apply to a call with a state (generation)")
            if current_mesh() is not None and spec(("length",), (t,))[0] is not None:
                raise ValueError("lengths, history_every: padded rows and state histories do not run split over "
                                 "the context axis")
            if history_every is not None and history_every != 1 and (t % history_every
                                                                       or history_every % self.op.chunk_size):
                raise ValueError(f"history_every: expected 1 or a multiple of the chunk size "
                                 f"{self.op.chunk_size} that divides T={t}, got {history_every}")
            if lengths is not None:
                real = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]
                g, beta = jnp.where(_per_token(real, g), g, 0.0), jnp.where(real[..., None], beta, 0.0)
            core = functools.partial(self._core, history_every=history_every)
        conv_state = None if state is None else self._group_channels(state.conv, 1)
        o, conv_state, rec, history = run_gdn_core(
            core, mixed, self._group_channels(self.conv_weight[...], 0), g, beta, conv_state,
            None if state is None else state.recurrent, starts, lengths, num_key_heads=self.hk,
            kernel_size=self.width, history=history_every is not None)
        return o, conv_state, rec, None if history is None else DeltaRuleHistory(*history)

    def _new_state(self, state: DeltaRuleState, conv_state, rec, history) -> DeltaRuleState:
        assert conv_state is not None and rec is not None  # a state in, a state out
        if history is not None:
            history = DeltaRuleHistory(self._ungroup_channels(history.conv, 2).astype(state.conv.dtype),
                                 history.recurrent)
        return DeltaRuleState(self._ungroup_channels(conv_state, 1).astype(state.conv.dtype), rec, history)


class GatedDeltaNet(DeltaRuleMixer):
    """Gated DeltaNet mixer: projections, causal conv, the gated delta rule
    (settings in `op`), gated RMSNorm (its gate z through `output_gate`:
    silu, or sigmoid as Qwen4-Exp may set it), output projection."""

    def __init__(self, hidden_size: int, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel_size: int, norm_eps: float, op: DeltaRuleOptions,
                 init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 allow_neg_eigval: bool = False, output_gate: Literal["silu", "sigmoid"] = "silu"):
        self.output_gate = output_gate
        self.hk, self.hv = num_key_heads, num_value_heads
        self.dk, self.dv = key_head_dim, value_head_dim
        self.width = conv_kernel_size
        self.eps = norm_eps
        self.beta_scale = 2.0 if allow_neg_eigval else 1.0
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.op = op
        h, std = hidden_size, init_std
        self.in_proj_qkvz = linear(h, 2 * self.hk * self.dk + 2 * self.hv * self.dv, dtype, param_dtype, std, rngs)
        self.in_proj_ba = linear(h, 2 * self.hv, dtype, param_dtype, std, rngs)
        bound = self.width ** -0.5  # PyTorch's depthwise Conv1d default (fan_in = kernel size)
        self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (self.conv_dim, self.width), param_dtype,
                                                        -bound, bound))
        # The decay parameters stay float32 whatever param_dtype is. dt_bias
        # starts at softplus^-1(dt), dt log-uniform in [1e-4, 1e-2], so decays
        # start near 1 (g = -A dt >= -0.16 per token). Hugging Face's ones give
        # decays down to exp(-21) per token, and Mamba's [1e-3, 1e-1] down to
        # exp(-1.6): both erase the state, and training from scratch on recall
        # then sits at chance for thousands of steps (docs/model.md).
        dt = jnp.exp(jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, jnp.log(1e-4), jnp.log(1e-2)))
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 0.01, 16.0)))
        self.norm_weight = nnx.Param(jnp.ones((self.dv,), param_dtype))
        self.out_proj = linear(self.hv * self.dv, h, dtype, param_dtype, std, rngs)

    def __call__(self, x: jax.Array, state: DeltaRuleState | None = None, segments: jax.Array | None = None,
                 lengths: jax.Array | None = None, history_every: int | None = None,
                 ) -> tuple[jax.Array, DeltaRuleState | None]:
        """x [B, T, hidden]. With a state: continue from it and return the new
        one; T == 1 takes the decode path (conv update + recurrent op). With
        segments [B, T] (the document of each token of a packed row), the
        conv window and the delta rule's state restart at every document.
        With a state, lengths [B] marks the tokens of each row past it as
        padding that leaves the state as it was (gate 0, beta 0; the conv
        window is taken before them), and history_every asks for the states
        after every that many tokens (1: the token recurrence, each token's;
        else a multiple of the chunk size, from the chunk states) in the new
        state's history. Returns (y [B, T, hidden], new state or None)."""
        b, t, _ = x.shape
        grp = self.hv // self.hk
        width = 2 * self.dk + grp * self.dv
        units = {"key_heads": self.hk, "value_heads": self.hk}
        # in_proj_qkvz's columns are already grouped per key head: [q_i | k_i | v_i | z_i]
        qkvz = self.in_proj_qkvz(x).reshape(b, t, self.hk, width + grp * self.dv)
        qkvz = constrain(qkvz, ("batch", "length", "key_heads", None), units=units)
        mixed = qkvz[..., :width]
        z = jnp.reshape(qkvz[..., width:], (b, t, self.hv, self.dv),
                        out_sharding=out_sharding(OUT, (b, t, self.hv, self.dv), units=units))
        ba = constrain(self.in_proj_ba(x).reshape(b, t, self.hk, 2 * grp), ("batch", "length", "key_heads", None),
                       units=units)
        gate_sharding = out_sharding(GATE, (b, t, self.hv), units=units)
        bb = jnp.reshape(ba[..., :grp], (b, t, self.hv), out_sharding=gate_sharding)
        a = jnp.reshape(ba[..., grp:], (b, t, self.hv), out_sharding=gate_sharding)
        beta = self.beta_scale * jax.nn.sigmoid(bb)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
        o, conv_state, rec, history = self._run(mixed, g, beta, state, segments, lengths, history_every)
        o = gated_rmsnorm(o, z, self.norm_weight[...], eps=self.eps, gate=self.output_gate)
        o = jnp.reshape(o, (b, t, self.hv * self.dv), out_sharding=out_sharding(
            ("batch", "length", "value_heads"), (b, t, self.hv * self.dv), units=units))
        y = self.out_proj(o, out_sharding=out_sharding(HIDDEN, (b, t, x.shape[-1])))
        if state is None:
            return y, None
        return y, self._new_state(state, conv_state, rec, history)
