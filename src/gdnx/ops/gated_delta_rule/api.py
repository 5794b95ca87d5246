"""Public gated delta rule ops: one contract, several implementations.

Shapes (docs/ops.md has the full contract):
    q, k          [B, T, HK, K]
    v             [B, T, HV, V]        HV a multiple of HK; value head h
    g, beta       [B, T, HV]           reads key head h // (HV // HK)
    initial_state [N, HV, K, V]        N = B, or len(cu_seqlens) - 1
"""

from __future__ import annotations

import jax
from jax.typing import DTypeLike

from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.dispatch import call, chunk_options, implementations, recurrent_options
from gdnx.ops.delta_rule.options import (
    CHUNK_IMPLEMENTATIONS,
    DEFAULTS,
    RECURRENT_IMPLEMENTATIONS,
    DeltaRuleOptions,
    Implementation,
    ResidualPolicy,
)
from gdnx.ops.delta_rule.tiles import GpuTiles, TpuTiles
from gdnx.ops.gated_delta_rule import pallas_gpu
from gdnx.ops.gated_delta_rule.math import VARIANT

# the op's table: one Backend per implementation (delta_rule/backend.py)
IMPLEMENTATIONS: dict[str, Backend] = implementations(VARIANT, pallas_gpu.BACKEND)


def chunk_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False, options: DeltaRuleOptions | None = None, chunk_size: int = DEFAULTS.chunk_size,
    state_dtype: DTypeLike = DEFAULTS.state_dtype, decay_dtype: DTypeLike = DEFAULTS.decay_dtype,
    implementation: Implementation | None = DEFAULTS.implementation, interpret: bool | None = DEFAULTS.interpret,
    tiles: GpuTiles | TpuTiles | None = None, residuals: ResidualPolicy = DEFAULTS.residuals,
    matmul_dtype: DTypeLike | None = DEFAULTS.matmul_dtype, output_chunk_states: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Gated delta rule over whole sequences, chunk by chunk.

    Args:
      q, k: [B, T, HK, K] queries and keys.
      v: [B, T, HV, V] values; HV is a multiple of HK and value head h reads
        key head h // (HV // HK).
      g: [B, T, HV] log decay (<= 0, not checked).
      beta: [B, T, HV] write strength in [0, 2] (above 1: negative eigenvalues
        of the transition, as OLMo-Hybrid uses; not checked, values are traced).
      scale: output scale, K ** -0.5 when None.
      initial_state: [N, HV, K, V] state before the first token of each
        sequence; zeros when None.
      output_final_state: also return the state after each sequence's last token.
      cu_seqlens: int [N + 1] offsets of N sequences packed in one row (B must
        be 1). The state starts from initial_state[n] at each start and never
        crosses a boundary. Values are checked when known at trace time.
      use_qk_l2norm: normalise q and k to unit length inside the op.
      options: the settings below as one DeltaRuleOptions (what a model
        fixes once), in place of the keywords chunk_size ... interpret.
      chunk_size: one of 16, 32, 64, 128; T need not be a multiple.
      state_dtype: dtype of the state and of every accumulation.
      decay_dtype: dtype of the gate cumulative sums and decay factors.
      implementation: None (pallas_tpu on TPU, pallas_gpu on GPU, xla on
        CPU), or one of "xla", "reference", "pallas_tpu", "pallas_gpu".
        A named implementation never falls back to another.
      interpret: Pallas implementations only. None runs the kernel in
        interpret mode exactly when the default backend is the CPU; False
        always lowers for the hardware (also from a CPU host, for
        jax.export); True always interprets.
      tiles: Pallas implementations only. None: the table's entry for the
        target device, fitted to the shapes (gdnx.ops.delta_rule.tiles);
        GpuTiles or TpuTiles to choose them, checked against the shapes.
      residuals: what the backward gets from the forward (hand-written VJPs:
        xla and the kernels). "save": each chunk's incoming state and the
        chunk inverse, named gdn_chunk_states and gdn_chunk_inverse for remat
        policies; "recompute": only the inputs, and the backward reruns the
        forward pass first.
      matmul_dtype: a dtype such as "bfloat16" rounds the operands of every
        matmul outside the chunk inverse to it, accumulating in state_dtype:
        one bf16 MXU / tensor-core pass instead of several, at the accuracy
        cost measured in docs/ops.md; state_dtype (float32) keeps every
        operand in it (exact float32 products). None: bfloat16 for the
        Pallas kernels with bfloat16 inputs, float32 otherwise.
      output_chunk_states: also return the state after every chunk
        [B, ceil(T / chunk_size), HV, K, V] (the last entry is the final
        state): what a prefix cache keeps at chunk boundaries. Forward only
        (not differentiable); no cu_seqlens. Every implementation gives it
        (the chunked ones from the states they save for their backward).

    Returns:
      (o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] in state_dtype
      or None), and the chunk states (state_dtype) when output_chunk_states.
    """
    opts = chunk_options(options, output_chunk_states, implementation=implementation, chunk_size=chunk_size,
                         state_dtype=state_dtype, decay_dtype=decay_dtype, residuals=residuals,
                         matmul_dtype=matmul_dtype, interpret=interpret)
    return call(VARIANT, IMPLEMENTATIONS, CHUNK_IMPLEMENTATIONS, "chunk_gated_delta_rule", opts, q, k, v, g, beta,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                tiles=tiles, history="chunks" if output_chunk_states else None)


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False, state_dtype: DTypeLike = DEFAULTS.state_dtype,
    decay_dtype: DTypeLike = DEFAULTS.decay_dtype, implementation: Implementation | None = None,
    output_token_states: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Gated delta rule token by token: decode steps, and the definition.

    Same arguments and results as `chunk_gated_delta_rule`, without
    chunk_size. implementation: None or "reference". output_token_states:
    also return the state after every token [B, T, HV, K, V] (no
    cu_seqlens): what speculative decoding selects from after verifying
    draft tokens.
    """
    opts = recurrent_options(implementation, state_dtype, decay_dtype, output_token_states)
    return call(VARIANT, IMPLEMENTATIONS, RECURRENT_IMPLEMENTATIONS, "recurrent_gated_delta_rule", opts,
                q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                tiles=None, history="tokens" if output_token_states else None)
