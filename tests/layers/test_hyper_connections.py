"""Hyper-connections against transformers' own modules (random weights,
float32, 1e-5 relative: the same operations in another order):
GLM-5-Next's manifold-constrained ones (one and 20 Sinkhorn iterations; the
mixing matrix's columns then sum to 1, its rows nearly) and Qwen4-Exp's gated residual (with
and without its injection weights), each with the block's output written
back into the streams as the decoder layers write it."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gdnx.layers.hyper_connections import GatedResidual, ManifoldHyperConnection, expand_streams, stream_mean
from gdnx.measure import relative_error

H, N = 16, 4


def _t(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, np.float32))


@pytest.mark.parametrize("iters", [1, 20])
def test_manifold_hyper_connection_matches_glm5_next(iters):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    config = transformers.Glm5NextTextConfig(hidden_size=H, hc_mult=N, hc_sinkhorn_iters=iters)
    rng = np.random.default_rng(iters)
    theirs = Glm5NextTextHyperConnection(config)
    fn = 0.3 * rng.standard_normal(((2 + N) * N, N * H))
    base, scale = rng.standard_normal((2 + N) * N), 1 + 0.5 * rng.standard_normal(3)
    with torch.no_grad():
        theirs.fn.copy_(_t(fn))
        theirs.base.copy_(_t(base))
        theirs.scale.copy_(_t(scale))
    ours = ManifoldHyperConnection(H, N, sinkhorn_iters=iters, eps=config.hc_eps, norm_eps=config.rms_norm_eps,
                                   init_std=0.02, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ours.fn[...] = jnp.asarray(fn.T, jnp.float32)
    ours.base[...] = jnp.asarray(base, jnp.float32)
    ours.scale[...] = jnp.asarray(scale, jnp.float32)
    streams = rng.standard_normal((2, 5, N, H)).astype(np.float32)
    out = rng.standard_normal((2, 5, H)).astype(np.float32)
    with torch.no_grad():
        post, comb, collapsed = theirs(_t(streams))
        new = post.unsqueeze(-1) * _t(out).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), _t(streams))
    got = ours(jnp.asarray(streams))
    for a, b in zip(got, (post, comb, collapsed), strict=True):
        assert relative_error(a, b.numpy()) <= 1e-5
    assert relative_error(ManifoldHyperConnection.combine(*got[:2], jnp.asarray(out), jnp.asarray(streams)),
                          new.numpy()) <= 1e-5
    if iters == 20:  # columns sum to 1 (the last normalisation), rows nearly (4% here, from skewed weights)
        np.testing.assert_allclose(np.asarray(got[1]).sum(-2), 1.0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[1]).sum(-1), 1.0, atol=0.04)
    np.testing.assert_allclose(stream_mean(expand_streams(jnp.asarray(out), N)), out, rtol=1e-6)


@pytest.mark.parametrize("combine", [True, False], ids=["block", "final"])
def test_gated_residual_matches_qwen4_exp(combine):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

    config = transformers.Qwen4ExpTextConfig(hidden_size=H, hc_count=N, hc_lowrank=6)
    torch.manual_seed(0)
    theirs = Qwen4ExpTextGatedResidual(config, use_combine=combine)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    ours = GatedResidual(H, N, 6, combine=combine, eps=config.rms_norm_eps, init_std=0.02, dtype=jnp.float32,
                         param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ours.norm.weight[...] = jnp.asarray(theirs.hc_norm.weight.detach().numpy())
    ours.down.kernel[...] = jnp.asarray(theirs.input_mix_weight_down.weight.detach().numpy().T)
    ours.up.kernel[...] = jnp.asarray(theirs.input_mix_weight_up.weight.detach().numpy().T)
    if combine:
        ours.inject_weight.kernel[...] = jnp.asarray(theirs.block_inject_weight.weight.detach().numpy().T)
    rng = np.random.default_rng(1)
    hyper = rng.standard_normal((2, 5, N * H)).astype(np.float32)
    out = rng.standard_normal((2, 5, H)).astype(np.float32)
    with torch.no_grad():
        want = theirs(_t(hyper))
    mixed, weights = ours(jnp.asarray(hyper))
    if not combine:
        assert weights is None and relative_error(mixed, want.numpy()) <= 1e-5
        return
    mixed_t, hyper_t, weights_t = want
    assert relative_error(mixed, mixed_t.numpy()) <= 1e-5 and relative_error(weights, weights_t.numpy()) <= 1e-5
    injected = hyper_t + (_t(out).unsqueeze(-2) * weights_t.unsqueeze(-1)).flatten(-2)
    assert relative_error(GatedResidual.inject(jnp.asarray(hyper), jnp.asarray(out), weights),
                          injected.numpy()) <= 1e-5
    with pytest.raises(ValueError, match="hyper: expected 64 features"):
        ours(jnp.zeros((1, 2, 3 * H)))
