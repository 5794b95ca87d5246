"""The routed experts split over the tensor axis both ways (by width, by
whole experts) give the one-device layer's outputs and gradients, on Auto
and Explicit meshes; auto picks by the width slice; an experts split that
the axis does not divide is refused naming both numbers."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gdnx.layers.moe import SparseMoE
from gdnx.parallel.moe import split_experts
from tests.parallel.helpers import mesh, worst_relative_error

# float32 sums regrouped over shards: agreement to a few ulps; a copy sent to the wrong shard is O(1)
TOL = 1e-5


def _layer(split: str) -> SparseMoE:
    return SparseMoE(16, num_experts=8, top_k=3, expert_size=8, shared_expert_size=8, norm_topk_prob=True,
                     init_std=0.3, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), split=split)


@pytest.mark.parametrize("mode", ["auto", "explicit"])
@pytest.mark.parametrize("split", ["width", "experts"])
def test_both_splits_match_one_device(split, mode):
    graphdef, params = nnx.split(_layer(split))
    x = jax.random.normal(jax.random.key(1), (4, 6, 16), jnp.float32)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * jnp.cos(y)), stats.counts

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
    ref, ref_counts = grad(params, x)
    with jax.set_mesh(mesh(mode, data=2, tensor=4)):
        assert split_experts(split, 8, 8) == (split == "experts")
        got, counts = jax.jit(grad)(params, x)
    err, where = worst_relative_error(got, ref)
    assert err <= TOL, f"{split} {mode}: {where} {err:.2e}"
    assert (jax.device_get(counts) == jax.device_get(ref_counts)).all()


def test_auto_splits_experts_where_a_width_slice_would_not_fill_the_lanes():
    m = mesh("auto", data=2, tensor=4)
    assert split_experts("auto", 512, 1024, m) is False    # 256 a device
    assert split_experts("auto", 512, 256, m) is True      # 64 a device
    assert split_experts("auto", 6, 256, m) is False       # 4 does not divide 6 experts: the width it is
    assert split_experts("experts", 8, 4096, m) is True
    assert split_experts("auto", 8, 8, mesh("auto", data=8)) is False  # no tensor axis
    with pytest.raises(ValueError, match=r"model.moe_split: experts needs the tensor axis \(4\) to divide "
                                         r"num_experts \(6\)"):
        split_experts("experts", 6, 256, m)
