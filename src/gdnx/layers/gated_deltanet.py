"""The Gated DeltaNet layer exactly as Qwen3-Next defines it.

in_proj_qkvz and in_proj_ba keep Hugging Face's per-key-head interleaved
layout (for key head i: [q_i | k_i | v of its G value heads | z of them],
and [b of its G value heads | a of them]), so weights load as they are and a
key head's group stays contiguous for tensor sharding. Then a depthwise
causal conv + SiLU over [q | k | v] (its own op), beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias) in float32, the delta rule with
l2-normalised q and k, a gated RMSNorm with z, and out_proj.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gdnx.layers.linear import linear
from gdnx.ops import causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule, gated_rmsnorm
from gdnx.ops import recurrent_gated_delta_rule


class GDNState(NamedTuple):
    """conv [B, conv_dim, kernel_size - 1] (oldest first), recurrent [B, HV, K, V]."""
    conv: jax.Array
    recurrent: jax.Array


def delta_rule_implementation(use_gdn_kernel: str, platform: str | None = None) -> str | None:
    """The op's implementation for a use_gdn_kernel setting: None lets the op
    choose (kernel where a compiled one exists, xla on CPU)."""
    if use_gdn_kernel == "auto":
        return None
    if use_gdn_kernel == "false":
        return "xla"
    platform = platform or jax.default_backend()
    if platform == "gpu":
        return "pallas_gpu"
    if platform != "tpu":
        warnings.warn("use_gdn_kernel=true on CPU: the Pallas TPU kernel runs in interpret mode (slow; "
                      "for checking numerics). use_gdn_kernel=auto runs the XLA path here.", stacklevel=3)
    return "pallas_tpu"


def check_platform(cfg, platform: str | None = None) -> None:
    """Refuse, before any work, GDN settings this machine cannot run."""
    platform = platform or jax.default_backend()
    if cfg.gdn_interpret is False and platform == "cpu":
        from gdnx.config.loading import ConfigError

        raise ConfigError("model.gdn_interpret: false compiles the Pallas kernel for a TPU or GPU, and this "
                          "machine has neither; leave it unset (interpret mode on CPU)")


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.width = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.op_options = dict(
            implementation=delta_rule_implementation(cfg.use_gdn_kernel), chunk_size=cfg.gdn_chunk_size,
            state_dtype=jnp.dtype(cfg.gdn_state_dtype), decay_dtype=jnp.dtype(cfg.gdn_decay_dtype),
            residuals=cfg.gdn_residuals, matmul_dtype=cfg.gdn_matmul_dtype)
        if cfg.gdn_interpret is not None:
            self.op_options["interpret"] = cfg.gdn_interpret
        h, std = cfg.hidden_size, cfg.initializer_range
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

    def zero_state(self, batch: int, dtype) -> GDNState:
        return GDNState(jnp.zeros((batch, self.conv_dim, self.width - 1), dtype),
                        jnp.zeros((batch, self.hv, self.dk, self.dv), self.op_options["state_dtype"]))

    def _split_projections(self, x):
        b, t, _ = x.shape
        grp = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).reshape(b, t, self.hk, 2 * self.dk + 2 * grp * self.dv)
        q, k, v, z = jnp.split(qkvz, [self.dk, 2 * self.dk, 2 * self.dk + grp * self.dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(b, t, self.hk, 2 * grp)
        bb, a = ba[..., :grp].reshape(b, t, self.hv), ba[..., grp:].reshape(b, t, self.hv)
        mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1)
        return mixed, z.reshape(b, t, self.hv, self.dv), bb, a

    def __call__(self, x, state: GDNState | None = None):
        """x [B, T, hidden]. With a state: continue from it and return the new
        one; T == 1 takes the decode path (conv update + recurrent op).
        Returns (y [B, T, hidden], new state or None)."""
        b, t, _ = x.shape
        mixed, z, bb, a = self._split_projections(x)
        w = self.conv_weight[...]
        if state is not None and t == 1:
            y, conv_state = causal_conv1d_update(mixed[:, 0], state.conv, w)
            mixed = y[:, None]
        else:
            mixed, conv_state = causal_conv1d(mixed, w, initial_state=None if state is None else state.conv,
                                              output_final_state=state is not None)
        kd = self.hk * self.dk
        q = mixed[..., :kd].reshape(b, t, self.hk, self.dk)
        k = mixed[..., kd:2 * kd].reshape(b, t, self.hk, self.dk)
        v = mixed[..., 2 * kd:].reshape(b, t, self.hv, self.dv)
        beta = jax.nn.sigmoid(bb)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
        h0 = None if state is None else state.recurrent
        common = dict(initial_state=h0, output_final_state=state is not None, use_qk_l2norm=True,
                      state_dtype=self.op_options["state_dtype"], decay_dtype=self.op_options["decay_dtype"])
        if state is not None and t == 1:
            o, rec = recurrent_gated_delta_rule(q, k, v, g, beta, **common)
        else:
            extra = {key: val for key, val in self.op_options.items() if key not in common}
            o, rec = chunk_gated_delta_rule(q, k, v, g, beta, **common, **extra)
        o = gated_rmsnorm(o, z, self.norm_weight[...], eps=self.eps)
        y = self.out_proj(o.reshape(b, t, self.hv * self.dv))
        return y, None if state is None else GDNState(conv_state.astype(state.conv.dtype), rec)
