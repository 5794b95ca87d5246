"""The routed experts split over the tensor axis both ways (by width, by
whole experts) and over the expert axis (token copies exchanged in an
all-to-all, or, for tokens too few to split, the same tokens on every
device) give the one-device layer's outputs and gradients, on Auto and
Explicit meshes; auto picks by the width slice; a split that an axis does
not divide is refused naming both numbers."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gdnx.layers import moe
from gdnx.layers.moe import SparseMoE
from gdnx.parallel.moe import split_experts
from tests.parallel.helpers import mesh, worst_relative_error

# float32 sums regrouped over shards: agreement to a few ulps; a copy sent to the wrong shard is O(1)
TOL = 1e-5


def _layer(split: str) -> SparseMoE:
    return SparseMoE(16, num_experts=8, top_k=3, expert_size=8, shared_expert_size=8, norm_topk_prob=True,
                     init_std=0.3, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), split=split)


def _check(split: str, mode: str, axes: dict, rows: int = 8, chunk: int | None = None, monkeypatch=None,
           exchange: bool = False):
    """exchange: the token copies go through an all-to-all (else none is made)."""
    graphdef, params = nnx.split(_layer(split))
    x = jax.random.normal(jax.random.key(1), (rows, 6, 16), jnp.float32)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * jnp.cos(y)), stats.counts

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
    ref, ref_counts = grad(params, x)
    if chunk is not None:
        monkeypatch.setattr(moe, "CHUNK_TOKENS", chunk)
    with jax.set_mesh(mesh(mode, **axes)):
        assert split_experts(split, 8, 8) == (split == "experts")
        step = jax.jit(grad)
        assert ("all_to_all" in step.lower(params, x).as_text()) == exchange
        got, counts = step(params, x)
    err, where = worst_relative_error(got, ref)
    assert err <= TOL, f"{split} {mode} {axes}: {where} {err:.2e}"
    assert (jax.device_get(counts) == jax.device_get(ref_counts)).all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "explicit"])
@pytest.mark.parametrize("split", ["width", "experts"])
def test_both_splits_match_one_device(split, mode):
    _check(split, mode, dict(data=2, tensor=4))


# 8 rows over data x expert: each device's token copies go to their experts' devices and back
@pytest.mark.parametrize(("split", "mode", "axes"), [
    ("width", "auto", dict(data=2, expert=4)),
    ("width", "explicit", dict(data=2, expert=4)),
    ("experts", "auto", dict(data=2, expert=2, tensor=2)),
    ("experts", "explicit", dict(data=2, expert=2, tensor=2)),
    ("width", "auto", dict(data=2, expert=2, tensor=2)),
])
def test_expert_axis_matches_one_device(split, mode, axes):
    _check(split, mode, axes, exchange=True)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all as its documentation states it, from
    all_gather (XLA:CPU has no ragged_all_to_all): each source's slice for
    this device written where the source said; a recv_sizes that disagrees
    with what the sources send makes the result NaN."""
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name)
    sources, starts, sizes, places = gather(operand), gather(input_offsets), gather(send_sizes), gather(output_offsets)
    r = jnp.arange(output.shape[0])
    result = output
    for i in range(n):
        start, size, at = starts[i, me], sizes[i, me], places[i, me]
        inside = ((r >= at) & (r < at + size)).reshape(-1, *(1,) * (output.ndim - 1))
        result = jnp.where(inside, sources[i][jnp.clip(start + r - at, 0, operand.shape[0] - 1)], result)
    if jnp.issubdtype(result.dtype, jnp.floating):
        result = jnp.where(jnp.all(recv_sizes == sizes[:, me]), result, jnp.nan)
    return result


@pytest.mark.parametrize(("split", "mode", "axes"), [
    ("width", "auto", dict(data=2, expert=4)),
    ("experts", "explicit", dict(data=2, expert=2, tensor=2)),
])
def test_ragged_exchange_matches_one_device(monkeypatch, split, mode, axes):
    """The exchange TPUs and GPUs run (ragged_all_to_all: the copies alone,
    not padded blocks), with the collective emulated per its documentation."""
    calls = []

    def emulated(*args, **kwargs):
        calls.append(1)
        return _ragged_all_to_all(*args, **kwargs)

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated)
    monkeypatch.setattr(moe, "RAGGED_PLATFORMS", ("cpu",))
    _check(split, mode, axes, exchange=True)  # the counts' all_to_all
    assert calls


def test_expert_axis_in_passes_matches_one_device(monkeypatch):
    # 8 tokens a pass over an expert axis of 4: 2 a device, 3 passes of each device's 6 tokens
    _check("width", "auto", dict(data=2, expert=4), chunk=8, monkeypatch=monkeypatch, exchange=True)


@pytest.mark.slow
def test_expert_axis_with_one_row_matches_one_device():
    # one row cannot be split over expert: every device of it sees the row and runs its own experts' copies
    _check("width", "auto", dict(data=2, expert=4), rows=1)


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
    with pytest.raises(ValueError, match=r"parallel.expert: the expert axis \(4\) must divide model.num_experts "
                                         r"\(6\)"):
        split_experts("auto", 6, 256, mesh("auto", data=2, expert=4))
    with pytest.raises(ValueError, match=r"tensor axis \(2\) to divide num_experts \(12\) / expert \(4\) = 3"):
        split_experts("experts", 12, 256, mesh("auto", expert=4, tensor=2))
