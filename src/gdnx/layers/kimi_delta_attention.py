"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi Linear.

Gated DeltaNet with a decay per key channel: q, k, v projections (fused
here per head, [q_i | k_i | v_i], so a head stays whole on a tensor shard;
Kimi's checkpoints store q_proj, k_proj, v_proj, regrouped on loading by
gdnx.checkpoints.hf_names), one depthwise causal conv + SiLU over q, k, v,
the forget gate through a low-rank projection (f_a_proj, f_b_proj) into
g = -exp(A_log) * softplus(f + dt_bias) per channel in float32,
beta = sigmoid(b_proj(x)), the delta rule (chunk_kda) with l2-normalised q
and k, an RMSNorm gated by sigmoid of a low-rank projection (g_a_proj,
g_b_proj), and out_proj. Every head has its own keys and values (no
grouping). The conv, the states and the serving paths are the GDN layer's
(DeltaRuleMixer). Ling 3's form (`low_rank_gates` false) projects the
forget and output gates in one step (f_proj, g_proj), and bounds the
decay: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.gated_deltanet import DeltaRuleMixer, DeltaRuleState
from gdnx.layers.linear import linear
from gdnx.layers.lora import Linear
from gdnx.ops import chunk_kda, gated_rmsnorm, kda_gate, recurrent_kda
from gdnx.ops.delta_rule.options import DeltaRuleOptions
from gdnx.parallel.gdn import GATE, OUT
from gdnx.parallel.rules import HIDDEN, constrain, out_sharding


def _project(x: jax.Array, direct: Linear | None, low: Linear | None, high: Linear | None) -> jax.Array:
    """A gate's projection: direct, or through the bottleneck (low, then high)."""
    if direct is not None:
        return direct(x)
    assert low is not None and high is not None  # one form or the other, as built
    return high(low(x))


class KimiDeltaAttention(DeltaRuleMixer):
    """KDA mixer: projections, causal conv, the per-channel gated delta
    rule (settings in `op`), sigmoid-gated RMSNorm, output projection."""

    chunk_op = staticmethod(chunk_kda)
    recurrent_op = staticmethod(recurrent_kda)

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, conv_kernel_size: int, norm_eps: float,
                 op: DeltaRuleOptions, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 low_rank_gates: bool = True, lower_bound: float | None = None):
        self.hk = self.hv = num_heads
        self.dk = self.dv = head_dim
        self.width = conv_kernel_size
        self.eps = norm_eps
        self.conv_dim = 3 * num_heads * head_dim
        self.op = op
        h, d, std = hidden_size, head_dim, init_std
        self.in_proj_qkv = linear(h, self.conv_dim, dtype, param_dtype, std, rngs)
        bound = self.width ** -0.5  # PyTorch's depthwise Conv1d default (fan_in = kernel size)
        self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (self.conv_dim, self.width), param_dtype,
                                                        -bound, bound))
        self.lower_bound = lower_bound
        # the gates' projections: through a head_dim bottleneck (Kimi) or direct (Ling)
        self.f_a_proj = linear(h, d, dtype, param_dtype, std, rngs) if low_rank_gates else None
        self.f_b_proj = linear(d, num_heads * d, dtype, param_dtype, std, rngs) if low_rank_gates else None
        self.f_proj = None if low_rank_gates else linear(h, num_heads * d, dtype, param_dtype, std, rngs)
        # float32 whatever param_dtype is, started as the GDN layer's decays
        # are (near 1: see gdnx.layers.gated_deltanet)
        dt = jnp.exp(jax.random.uniform(rngs.params(), (num_heads * d,), jnp.float32, jnp.log(1e-4),
                                        jnp.log(1e-2)))
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (num_heads,), jnp.float32, 0.01, 16.0)))
        self.b_proj = linear(h, num_heads, dtype, param_dtype, std, rngs)
        self.g_a_proj = linear(h, d, dtype, param_dtype, std, rngs) if low_rank_gates else None
        self.g_b_proj = linear(d, num_heads * d, dtype, param_dtype, std, rngs) if low_rank_gates else None
        self.g_proj = None if low_rank_gates else linear(h, num_heads * d, dtype, param_dtype, std, rngs)
        self.norm_weight = nnx.Param(jnp.ones((d,), param_dtype))
        self.out_proj = linear(num_heads * d, h, dtype, param_dtype, std, rngs)

    def __call__(self, x: jax.Array, state: DeltaRuleState | None = None, segments: jax.Array | None = None,
                 lengths: jax.Array | None = None, history_every: int | None = None,
                 ) -> tuple[jax.Array, DeltaRuleState | None]:
        """As GatedDeltaNet.__call__."""
        b, t, _ = x.shape
        h, d = self.hv, self.dk
        units = {"key_heads": h, "value_heads": h}
        heads = out_sharding(OUT, (b, t, h, d), units=units)
        mixed = constrain(self.in_proj_qkv(x).reshape(b, t, h, 3 * d), ("batch", "length", "key_heads", None),
                          units=units)
        f = jnp.reshape(_project(x, self.f_proj, self.f_a_proj, self.f_b_proj), (b, t, h, d), out_sharding=heads)
        g = kda_gate(f, self.A_log[...], self.dt_bias[...], lower_bound=self.lower_bound)
        beta = constrain(jax.nn.sigmoid(self.b_proj(x)), GATE, units=units)
        o, conv_state, rec, history = self._run(mixed, g, beta, state, segments, lengths, history_every)
        gate = jnp.reshape(_project(x, self.g_proj, self.g_a_proj, self.g_b_proj), (b, t, h, d), out_sharding=heads)
        o = gated_rmsnorm(o, gate, self.norm_weight[...], eps=self.eps, gate="sigmoid")
        o = jnp.reshape(o, (b, t, h * d), out_sharding=out_sharding(("batch", "length", "value_heads"), (b, t, h * d),
                                                                    units=units))
        y = self.out_proj(o, out_sharding=out_sharding(HIDDEN, (b, t, x.shape[-1])))
        if state is None:
            return y, None
        return y, self._new_state(state, conv_state, rec, history)
