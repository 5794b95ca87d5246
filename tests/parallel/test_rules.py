"""Logical axis rules, the mesh from config, and parameter placement."""

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gdnx.config.reading import load_config
from gdnx.config.schema import ParallelConfig
from gdnx.models import CausalLM
from gdnx.parallel import constrain, mesh_shape, shardings, spec
from tests.parallel.helpers import mesh
from tests.parallel.helpers import MODEL


def test_spec_splits_batch_over_data_and_fsdp_and_heads_over_tensor():
    m = mesh("auto", data=2, fsdp=2, tensor=2)
    assert spec(("batch", "length", "key_heads", None), (8, 32, 4, 48), mesh=m) == P(("data", "fsdp"), None,
                                                                                     "tensor", None)


def test_spec_drops_a_mesh_axis_that_does_not_divide_the_dim():
    m = mesh("auto", data=8)
    assert spec(("batch", "length"), (2, 32), mesh=m) == P(None, None)  # a microbatch of 2 on 8 data devices
    m = mesh("auto", data=2, fsdp=4)
    assert spec(("batch",), (2,), mesh=m) == P("data")                  # fsdp (4) no longer divides 2 / 2
    m = mesh("auto", data=2, tensor=4)
    # 2 key heads cannot go over 4 tensor devices, even though their 96 columns could
    assert spec(("embed", "key_heads"), (64, 96), units={"key_heads": 2}, mesh=m) == P(None, None)


def test_no_mesh_means_no_placement():
    x = jax.numpy.ones((2, 3))
    assert constrain(x, ("batch", "length")) is x
    assert spec(("batch", "length"), (2, 3)) == P(None, None)


def test_mesh_shape_fills_the_rest_axis_and_checks_the_device_count():
    assert mesh_shape(ParallelConfig(tensor=2, context=2), 8) == (2, 1, 1, 2, 2)
    assert mesh_shape(ParallelConfig(data=1, expert=-1, tensor=2), 8) == (1, 1, 4, 2, 1)
    with pytest.raises(ValueError, match="there are 8 devices"):
        mesh_shape(ParallelConfig(data=2, tensor=2), 8)
    with pytest.raises(ValueError, match="does not divide"):
        mesh_shape(ParallelConfig(tensor=3), 8)


@pytest.mark.parametrize("override,message", [
    ("parallel.tensor=0", "parallel.tensor: expected a positive axis size or -1"),
    ("parallel.fsdp=-1", "parallel.fsdp: only one axis can be -1"),
    ("parallel.shard_mode=manual", "parallel.shard_mode: expected 'auto' or 'explicit'"),
    ("parallel.pipeline=2", "parallel.pipeline: unknown key"),
    ("parallel.expert=2", r"parallel.expert: an expert axis \(2\) splits routed experts, and the model has none"),
])
def test_parallel_config_errors_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("tiny", [override])


def test_an_expert_axis_that_does_not_divide_the_experts_names_both():
    with pytest.raises(ValueError, match=r"parallel.expert: the expert axis \(3\) must divide model.num_experts "
                                         r"\(4\)"):
        load_config("tiny", [*MODEL, "parallel.expert=3"])


def test_parameters_split_by_whole_head_groups():
    cfg = load_config("tiny", MODEL).model
    params = nnx.state(CausalLM(cfg), nnx.Param)
    s = shardings(params, cfg, mesh("explicit", data=2, fsdp=2, tensor=2))
    gdn, attn = s["layers"][0]["mixer"], s["layers"][1]["mixer"]
    assert gdn["in_proj_qkvz"]["kernel"].get_value().spec == P("fsdp", "tensor")   # 4 key heads, 2 per shard
    assert gdn["out_proj"]["kernel"].get_value().spec == P("tensor", "fsdp")
    assert gdn["A_log"].get_value().spec == P("tensor")
    assert gdn["conv_weight"].get_value().spec == P(None, None)                    # [q | k | v] order: kept whole
    assert attn["k_proj"]["kernel"].get_value().spec == P("fsdp", "tensor")        # 2 kv heads over 2
    # the experts' width of 32 over 2 is 16 lanes: auto splits whole experts (4 over 2); by width on request
    assert s["layers"][1]["mlp"]["experts_down"].get_value().spec == P("tensor", None, "fsdp")
    assert s["layers"][1]["mlp"]["experts_gate"].get_value().spec == P("tensor", "fsdp", None)
    width = cfg.model_copy(update={"moe_split": "width"})
    s = shardings(params, width, mesh("explicit", data=2, fsdp=2, tensor=2))
    assert s["layers"][1]["mlp"]["experts_down"].get_value().spec == P(None, "tensor", "fsdp")
    assert s["embed_tokens"]["embedding"].get_value().spec == P("tensor", "fsdp")
    assert s["norm"]["weight"].get_value().spec == P(None)
