"""Parameter placement: every matrix of every family has declared axes."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from gdnx.config.reading import load_config
from gdnx.models import CausalLM
from gdnx.parallel import shardings
from gdnx.parallel.params import _TABLE, _names, logical_axes
from gdnx.stacking import STACKED, layer_ndim
from gdnx.training.step import make_optimizer
from tests.parallel.helpers import mesh

KINDS = [("qwen3_next", 4), ("qwen3_5", 0), ("qwen3_5", 4), ("olmo_hybrid", 0), ("kimi_linear", 4),
         ("bailing_hybrid", 4), ("lara_mini", 4)]
# what a family needs beyond the tiny model's fields
_LATENT = ["model.linear_value_head_dim=64", "model.kv_lora_rank=16", "model.q_lora_rank=8", "model.qk_nope_head_dim=8",
           "model.qk_rope_head_dim=8", "model.v_head_dim=16"]
FAMILY_FIELDS = {"kimi_linear": ["model.rope_theta=null", *_LATENT], "bailing_hybrid": _LATENT,
                 "lara_mini": ["model.sliding_window=16", "model.partial_rotary_factor=1.0"]}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("family, experts", KINDS, ids=[f"{f}-{e}experts" for f, e in KINDS])
def test_every_matrix_has_its_axes_from_the_table(family, experts, scan):
    """Built abstractly (shapes only): each parameter of two or more dims per
    layer finds its own entry in the table (a renamed projection would not,
    and is refused below), and the optimizer's moments place like it."""
    over = [f"model.family={family}", f"model.num_experts={experts}", "model.num_hidden_layers=8",
            "model.layer_types=null", "model.full_attention_interval=4", f"model.scan_layers={str(scan).lower()}",
            *FAMILY_FIELDS.get(family, [])]
    if experts:
        over += ["model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
                 "model.shared_expert_intermediate_size=32"]
    cfg = load_config("tiny", over).model
    params = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg)), nnx.Param)
    matrices = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = _names(path)
        if layer_ndim(path, x.ndim) >= 2:
            matrices += 1
            key = tuple(n for n in names if n != STACKED)[-2:]
            assert key in _TABLE, names
            assert logical_axes(names, x.ndim)[-len(_TABLE[key]):] == _TABLE[key]
    assert matrices >= 10
    m = mesh("auto", fsdp=2, tensor=2)
    placed = shardings(params, cfg, m)
    assert len(jax.tree.leaves(placed)) == len(jax.tree.leaves(params))
    moments = jax.eval_shape(make_optimizer(load_config("tiny", over).train).init, params)
    assert jax.tree.leaves(shardings(moments, cfg, m))


def test_an_undeclared_matrix_is_refused_not_replicated():
    m = mesh("auto", fsdp=2, tensor=2)
    cfg = load_config("tiny", []).model
    renamed = {"layers": {0: {"mixer": {"in_proj_qkvzz": {"kernel": np.zeros((64, 64), np.float32)}}}}}
    with pytest.raises(ValueError, match="parameter layers/0/mixer/in_proj_qkvzz/kernel \\(rank 2\\): no sharding"):
        shardings(renamed, cfg, m)
    vector = {"layers": {0: {"mixer": {"new_bias": np.zeros((64,), np.float32)}}}}
    assert shardings(vector, cfg, m)["layers"][0]["mixer"]["new_bias"].spec == jax.sharding.PartitionSpec(None)


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_ngram_table_lookups_leave_the_rows_in_place(mode):
    """Qwen4-Exp's n-gram tables (about 41B parameters per layer at its
    sizes) have their rows split over fsdp x tensor: a lookup gathers each
    device's own rows and sums them over the mesh. The compiled program
    moves the ids and the looked-up rows, never the table: no collective
    carries as many elements as the table's part on a device."""
    from gdnx.layers.ngram_embedding import NGramEmbedding

    m = mesh(mode, fsdp=2, tensor=4)
    rows, dim = 1 << 14, 16
    table = NGramEmbedding(rows, dim, init_std=0.02, param_dtype=np.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(table)
    with jax.set_mesh(m):
        # placed as a per-layer embedding's table (the table's name under its module's)
        placed = jax.device_put(state, shardings({"embedding": state}, load_config("tiny", []).model, m)["embedding"])
        assert placed["table"].sharding.spec == jax.sharding.PartitionSpec(("fsdp", "tensor"), None)
        ids = jax.random.randint(jax.random.key(0), (4, 32, 8), 0, rows)
        lookup = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))
        hlo = lookup.lower(placed, ids).compile().as_text()
        got = lookup(placed, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(state["table"][...])[np.asarray(ids)].reshape(4, 32, -1))
    moved = re.findall(r"= \w+\[([\d,]*)\](?:\{[^}]*\})? (?:all-gather|all-reduce|all-to-all|collective-permute)"
                       r"(?:-start)?\(", hlo)
    sizes = [int(np.prod([int(d) for d in shape.split(",") if d])) for shape in moved]
    assert sizes and max(sizes) < rows * dim // 8, sizes
