"""Public Kimi Delta Attention (KDA) ops: the gated delta rule with one log
decay per key channel.

Shapes as for `chunk_gated_delta_rule` except the gate:
    q, k          [B, T, HK, K]
    v             [B, T, HV, V]        HV a multiple of HK
    g             [B, T, HV, K]        log decay per key channel, <= 0
    beta          [B, T, HV]
    initial_state [N, HV, K, V]

    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (x) beta_t (v_t - S_t^T k_t);  o_t = scale S_t^T q_t

docs/ops.md says how the chunked form stays exact for every g <= 0.
"""

from __future__ import annotations

import jax
from jax.typing import DTypeLike

from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.dispatch import Gate, call, chunk_options, implementations, recurrent_options
from gdnx.ops.delta_rule.options import (
    CHUNK_IMPLEMENTATIONS,
    DEFAULTS,
    RECURRENT_IMPLEMENTATIONS,
    DeltaRuleOptions,
    Implementation,
    ResidualPolicy,
)
from gdnx.ops.delta_rule.tiles import GpuTiles, TpuTiles
from gdnx.ops.kda import pallas_gpu
from gdnx.ops.kda.gates import check_gate, kda_gate
from gdnx.ops.kda.math import VARIANT

# the op's table: the gated delta rule's implementations, with KDA's chunk algebra
IMPLEMENTATIONS: dict[str, Backend] = implementations(VARIANT, pallas_gpu.BACKEND)


def _gate(g, A_log, dt_bias, lower_bound) -> Gate | None:
    if A_log is None:
        for name, x in (("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if x is not None:
                raise ValueError(f"{name}: given without A_log; the op applies a gate function only with A_log")
        return None
    if not hasattr(g, "shape"):
        return None  # the op's own check of g says what is wrong
    params = check_gate(tuple(g.shape), A_log, dt_bias, lower_bound)
    return Gate(kda_gate, (params.A_log, params.dt_bias), (("lower_bound", params.lower_bound),))


def chunk_kda(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False, A_log: jax.Array | None = None, dt_bias: jax.Array | None = None,
    lower_bound: float | None = None, options: DeltaRuleOptions | None = None,
    chunk_size: int = DEFAULTS.chunk_size, state_dtype: DTypeLike = DEFAULTS.state_dtype,
    decay_dtype: DTypeLike = DEFAULTS.decay_dtype, implementation: Implementation | None = DEFAULTS.implementation,
    interpret: bool | None = DEFAULTS.interpret, tiles: GpuTiles | TpuTiles | None = None,
    residuals: ResidualPolicy = DEFAULTS.residuals, matmul_dtype: DTypeLike | None = DEFAULTS.matmul_dtype,
    output_chunk_states: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """KDA over whole sequences, chunk by chunk.

    Arguments and results as `chunk_gated_delta_rule`'s, except:

      g: [B, T, HV, K] log decay per key channel, any value <= 0 (not
        checked; values are traced): gates of -30 per step and channels
        that barely decay next to ones that decay hard are exact to float32
        rounding, with no bound on the gate.
      A_log, dt_bias, lower_bound: give A_log ([HV] values) to pass the raw
        gate input as g and have the op apply the gate function
        (gates.kda_gate): -exp(A_log) softplus(g + dt_bias), or with
        lower_bound < 0 the bounded lower_bound sigmoid(exp(A_log)
        (g + dt_bias)); dt_bias holds HV * K values or is None. Gradients
        reach g, A_log and dt_bias.
      implementation: None (pallas_tpu on TPU, pallas_gpu on GPU, xla on
        CPU), or one of "xla", "pallas_tpu", "pallas_gpu", "reference". A
        named implementation never falls back to another.
      interpret, tiles: as chunk_gated_delta_rule's, for the Pallas
        implementations.
    """
    opts = chunk_options(options, output_chunk_states, implementation=implementation, chunk_size=chunk_size,
                         state_dtype=state_dtype, decay_dtype=decay_dtype, residuals=residuals,
                         matmul_dtype=matmul_dtype, interpret=interpret)
    return call(VARIANT, IMPLEMENTATIONS, CHUNK_IMPLEMENTATIONS, "chunk_kda", opts, q, k, v, g, beta,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                tiles=tiles, history="chunks" if output_chunk_states else None,
                gate=_gate(g, A_log, dt_bias, lower_bound))


def recurrent_kda(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False, A_log: jax.Array | None = None, dt_bias: jax.Array | None = None,
    lower_bound: float | None = None, state_dtype: DTypeLike = DEFAULTS.state_dtype,
    decay_dtype: DTypeLike = DEFAULTS.decay_dtype, implementation: Implementation | None = None,
    output_token_states: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """KDA token by token: decode steps, and the definition.

    Same arguments and results as `chunk_kda`, without chunk_size and the
    chunked knobs. implementation: None or "reference". output_token_states:
    also return the state after every token [B, T, HV, K, V] (no
    cu_seqlens).
    """
    opts = recurrent_options(implementation, state_dtype, decay_dtype, output_token_states)
    return call(VARIANT, IMPLEMENTATIONS, RECURRENT_IMPLEMENTATIONS, "recurrent_kda", opts, q, k, v, g, beta,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                tiles=None, history="tokens" if output_token_states else None,
                gate=_gate(g, A_log, dt_bias, lower_bound))
