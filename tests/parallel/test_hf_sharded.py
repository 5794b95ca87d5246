"""Hugging Face directories loaded sharded on the 8-device mesh: every
parameter created with its mesh sharding from the files' slices, equal bit
for bit to the whole load, for each family (as transformers saves it),
scanned or not, with experts per expert or fused; and saving the sharded
model writes the same bytes as saving the whole one."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from gdnx.models import CausalLM
from gdnx.parallel import shardings
from tests.parallel.helpers import mesh

# qwen4_exp: its n-gram tables' rows read across the checkpoint's pieces (60 and 78 rows each) in each device's slice
KINDS = ("qwen3_next", "qwen3_next_moe", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "qwen4_exp")
MESHES = {"fsdp8": dict(data=1, fsdp=8), "fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model of each family saved by transformers. torch is
    loaded in a child process: this process (XLA's compiler) stays without it."""
    root = tmp_path_factory.mktemp("hf")
    script = ("import sys; from tests.helpers.hf_models import random_hf_model\n"
              "for kind in sys.argv[2:]: random_hf_model(kind).save_pretrained(f'{sys.argv[1]}/{kind}')")
    subprocess.run([sys.executable, "-c", script, str(root), *KINDS], check=True, timeout=300,
                   cwd=Path(__file__).resolve().parents[2])
    return {kind: root / kind for kind in KINDS}


def _params(model) -> dict:
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _assert_same(sharded, whole, m):
    got, want = _params(sharded), _params(whole)
    expected = shardings(nnx.state(whole, nnx.Param), whole.config, m)
    placed = dict(nnx.to_flat_state(expected))
    assert got.keys() == want.keys()
    for path, var in got.items():
        value = var[...]
        assert value.sharding.is_equivalent_to(placed[path], value.ndim), path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[path][...]), err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_load_equals_whole_load(hf_dirs, kind, mesh_name):
    m = mesh("auto", **MESHES[mesh_name])
    sharded = CausalLM.from_pretrained(hf_dirs[kind], mesh=m)
    _assert_same(sharded, CausalLM.from_pretrained(hf_dirs[kind]), m)


def test_sharded_load_of_a_scanned_stack(hf_dirs):
    """Scanned: a stacked parameter's slice gathers its layers' slices."""
    m = mesh("auto", **MESHES["fsdp4_tensor2"])
    sharded = CausalLM.from_pretrained(hf_dirs["qwen3_5_moe"], mesh=m, scan_layers=True)
    _assert_same(sharded, CausalLM.from_pretrained(hf_dirs["qwen3_5_moe"], scan_layers=True), m)


def test_sharded_load_of_fused_experts(hf_dirs, tmp_path):
    """Experts fused as transformers 5 keeps them in memory (gate_up [E, 2I,
    H], down [E, H, I]): the up half is read from the second half's rows."""
    source = hf_dirs["qwen3_next_moe"]
    tensors = load_file(source / "model.safetensors")
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts"
        for part in ("gate", "up", "down"):
            stacked = np.stack([tensors.pop(f"{prefix}.{e}.{part}_proj.weight") for e in range(4)])
            tensors[f"{prefix}.{part}"] = stacked
        tensors[f"{prefix}.gate_up_proj"] = np.concatenate([tensors.pop(f"{prefix}.gate"),
                                                             tensors.pop(f"{prefix}.up")], axis=1)
        tensors[f"{prefix}.down_proj"] = tensors.pop(f"{prefix}.down")
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(tensors, fused / "model.safetensors")
    (fused / "config.json").write_text((source / "config.json").read_text())
    m = mesh("auto", **MESHES["fsdp4_tensor2"])
    _assert_same(CausalLM.from_pretrained(fused, mesh=m), CausalLM.from_pretrained(source), m)


@pytest.mark.parametrize("kind, scan", [("int8", False), ("fp8", True)])
def test_sharded_quantized_load_equals_whole_load(hf_dirs, kind, scan):
    """model.quantize: each device quantizes the whole blocks its part
    touches (blocks of 16 x 24, cut by the shards), the values and factors
    equal bit for bit to quantizing the whole load; scanned stacks too."""
    m = mesh("auto", **MESHES["fsdp4_tensor2"])
    over = dict(quantize=kind, quantize_block=(16, 24), scan_layers=scan)
    _assert_same(CausalLM.from_pretrained(hf_dirs["qwen3_next_moe"], mesh=m, **over),
                 CausalLM.from_pretrained(hf_dirs["qwen3_next_moe"], **over), m)


@pytest.mark.slow
def test_sharded_load_of_an_mtp_module(hf_dirs, tmp_path):
    """The multi-token prediction module is split like the layers it copies:
    equal bit for bit to the whole load, and so are its logits."""
    from tests.helpers.mtp import mtp_checkpoint

    directory, _, _ = mtp_checkpoint(hf_dirs["qwen3_next_moe"], tmp_path / "mtp", np.random.default_rng(0))
    m = mesh("auto", **MESHES["fsdp4_tensor2"])
    sharded, whole = CausalLM.from_pretrained(directory, mesh=m), CausalLM.from_pretrained(directory)
    _assert_same(sharded, whole, m)
    toks = np.random.default_rng(0).integers(0, 97, (2, 12))
    with jax.set_mesh(m):
        got = np.asarray(jax.jit(lambda t: sharded.mtp_logits(t))(toks))
    np.testing.assert_allclose(got, np.asarray(whole.mtp_logits(toks)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_quantized_experts_on_an_expert_axis_compute_what_one_device_does(hf_dirs, mode):
    """Experts quantized in blocks that tile them (16 x 16) reach the grouped
    matmuls as they are held (qwix.QArray), split whole over the expert
    axis with their factors: the logits equal one device's."""
    m = mesh(mode, data=2, expert=4)
    over = dict(quantize="fp8", quantize_block=(16, 16))
    toks = np.random.default_rng(0).integers(0, 97, (2, 12))
    whole = CausalLM.from_pretrained(hf_dirs["qwen3_next_moe"], **over)
    sharded = CausalLM.from_pretrained(hf_dirs["qwen3_next_moe"], mesh=m, **over)
    with jax.set_mesh(m):
        got = np.asarray(jax.jit(lambda t: sharded(t))(toks))
    np.testing.assert_allclose(got, np.asarray(whole(toks)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts", ["per_expert", "fused"])
def test_sharded_load_of_an_fp8_checkpoint(hf_dirs, tmp_path, experts):
    """Block-scaled FP8 (blocks of 16 x 24: partial at the edges, and cut
    by the shards' slices): each device dequantizes its part, equal bit for
    bit to the whole load; fused experts take one block grid per expert."""
    from tests.helpers.fp8 import fp8_tensors, write_fp8

    source = hf_dirs["qwen3_next_moe"]
    tensors = load_file(source / "model.safetensors")
    if experts == "fused":
        for layer in range(4):
            prefix = f"model.layers.{layer}.mlp.experts"
            stack = {part: np.stack([tensors.pop(f"{prefix}.{e}.{part}_proj.weight") for e in range(4)])
                     for part in ("gate", "up", "down")}
            tensors[f"{prefix}.gate_up_proj"] = np.concatenate([stack["gate"], stack["up"]], axis=1)
            tensors[f"{prefix}.down_proj"] = stack["down"]
    quantized, _, kept = fp8_tensors(tensors, (16, 24))
    write_fp8(tmp_path / "fp8", json.loads((source / "config.json").read_text()), quantized, (16, 24), kept)
    m = mesh("auto", **MESHES["fsdp4_tensor2"])
    _assert_same(CausalLM.from_pretrained(tmp_path / "fp8", mesh=m), CausalLM.from_pretrained(tmp_path / "fp8"), m)


def test_saving_a_sharded_model_writes_the_same_bytes(hf_dirs, tmp_path):
    m = mesh("auto", **MESHES["fsdp4_tensor2"])
    CausalLM.from_pretrained(hf_dirs["qwen3_5_moe"], mesh=m).save_pretrained(tmp_path / "sharded")
    CausalLM.from_pretrained(hf_dirs["qwen3_5_moe"]).save_pretrained(tmp_path / "whole")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "sharded" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert jax.device_count() == 8
