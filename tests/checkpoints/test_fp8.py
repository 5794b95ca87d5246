"""Block-scaled FP8 checkpoints (gdnx.checkpoints.fp8) in the published
layout, built here from each family's tiny checkpoint: every matrix but
the embeddings, the head, the routers and the shared experts' gates stored
as float8_e4m3fn with a weight_scale_inv per block (blocks that do not
divide the matrices, so the edge blocks are partial; float32, bfloat16 and
UE8M0 factors), config.json's quantization_config naming the method. gdnx
reads them dequantized; transformers reads the same values written out in
float32. The logits agree to 1e-5 (float32 on both sides, the same weight
values: only the two implementations' summation orders differ, as in the
other parity tests). Bad checkpoints are refused naming the tensor or the
method."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from gdnx.checkpoints.fp8 import FACTORS, FLOAT8, RawTensors
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from tests.helpers.fp8 import fp8_checkpoint, fp8_values
from tests.helpers.hf_models import KINDS, hf_logits, tokens
from tests.helpers.tiers import fast_only

# every family; blocks that do not divide the tiny matrices (partial edges) and every factor format
CASES = [("qwen3_next_moe", (16, 24), "float32"), ("qwen3_5", (128, 128), "float32"),
         ("qwen3_5_moe", (16, 16), "ue8m0"), ("olmo_hybrid", (32, 12), "bfloat16"),
         ("kimi_linear", (16, 24), "ue8m0"), ("bailing_hybrid", (8, 16), "float32"),
         ("lara_mini", (16, 16), "bfloat16")]


@pytest.mark.parametrize("kind, block, factors", fast_only(CASES, lambda c: c[0] in ("qwen3_next_moe", "qwen3_5")),
                         ids=[c[0] for c in CASES])
def test_fp8_checkpoint_matches_transformers_on_its_values(hf_checkpoints, tmp_path, kind, block, factors):
    stored = fp8_checkpoint(hf_checkpoints.path(kind), tmp_path / "fp8", tmp_path / "plain", block, factors)
    assert sum(k.endswith("_scale_inv") for k in stored) >= 8
    hf = getattr(transformers, KINDS[kind][1]).from_pretrained(tmp_path / "plain").eval()
    model = CausalLM.from_pretrained(tmp_path / "fp8")
    toks = tokens(2, 24)
    assert relative_error(np.asarray(model(toks)), hf_logits(hf, toks)) <= 1e-5


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor_or_method(hf_checkpoints, tmp_path):
    stored = fp8_checkpoint(hf_checkpoints.path("qwen3_next"), tmp_path / "fp8", tmp_path / "plain", (16, 16))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    name = next(k for k in stored if k.endswith("o_proj.weight"))

    def refused(tensors, cfg, match):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "fp8", d)
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=match):
            CausalLM.from_pretrained(d)

    gptq = {**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    refused(stored, gptq, r"quantization_config.quant_method is 'gptq'; gdnx reads fp8")
    refused({k: v for k, v in stored.items() if k != name + "_scale_inv"}, config,
            rf"{name} is float8 with no {name}_scale_inv beside it")
    refused({**stored, name + "_scale_inv": stored[name + "_scale_inv"][:1]}, config,
            rf"{name}_scale_inv has shape \(1, \d+\); {name} .* needs")
    refused(stored, {k: v for k, v in config.items() if k != "quantization_config"},
            r"model\.layers\.\d+\.\S+ is float8 and config.json has no quantization_config")


def test_an_fp8_checkpoint_held_as_fp8_keeps_its_values_and_factors(hf_checkpoints, tmp_path):
    """model.quantize=fp8 on an FP8 checkpoint takes its blocks (16 x 24
    here) and holds what it stores: a routed expert's float8 values and
    factors are the file's (transposed to gdnx's [in, out]), the values bit
    for bit, and the logits near those of the dequantized load. Quantizing it again as
    int8 is refused."""
    stored = fp8_checkpoint(hf_checkpoints.path("qwen3_next_moe"), tmp_path / "fp8", tmp_path / "plain", (16, 24))
    held = CausalLM.from_pretrained(tmp_path / "fp8", quantize="fp8")
    assert tuple(held.config.quantize_block) == (16, 24)
    experts = held.layers[0].mlp
    file_values = np.stack([stored[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(4)])
    file_factors = np.stack([stored[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"] for e in range(4)])
    np.testing.assert_array_equal(np.asarray(experts.experts_down[...]).view(np.uint8),
                                  file_values.transpose(0, 2, 1).view(np.uint8))
    # the factors found again from the dequantized values: the file's to a float32 ulp ((s x 448) / 448)
    np.testing.assert_allclose(np.asarray(experts.experts_down_scale[...]), file_factors.transpose(0, 2, 1),
                               rtol=2.5e-7)
    toks = tokens(2, 24)
    plain = CausalLM.from_pretrained(tmp_path / "fp8")
    # the projections gdnx regroups by head (GDN's q|k|v|z) take new blocks: a second rounding there only
    assert relative_error(np.asarray(held(toks)), np.asarray(plain(toks))) <= 2e-2
    with pytest.raises(ValueError, match=r"model.quantize: .* is already quantized \(fp8, blocks of 16 x 24\)"):
        CausalLM.from_pretrained(tmp_path / "fp8", quantize="int8")


@pytest.mark.parametrize("kind", fast_only(["qwen3_next_moe", "kimi_linear"], lambda k: k == "qwen3_next_moe"))
def test_a_model_held_as_fp8_is_written_back_in_the_fp8_layout(hf_checkpoints, tmp_path, kind):
    """save_pretrained(fp8_layout=True) of an FP8 checkpoint held as fp8
    writes the published layout again: every tensor the file held, under its
    name and dtype; each float8 matrix the file's bit for bit and its factors
    to a float32 ulp where gdnx holds the file's transpose (the MLPs,
    experts and output projections), within float8's rounding where it
    fuses or regroups by head (quantized again in the file's blocks); the routers, which gdnx keeps
    unquantized (Kimi's file quantizes them), as the float values they
    stood for; config.json's quantization_config with the blocks. Read
    back it computes what the held model does, as fp8 and dequantized."""
    stored = fp8_checkpoint(hf_checkpoints.path(kind), tmp_path / "fp8", tmp_path / "plain", (16, 24))
    held = CausalLM.from_pretrained(tmp_path / "fp8", quantize="fp8")
    held.save_pretrained(tmp_path / "out", fp8_layout=True)
    written = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in _read(f).items()}
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    routers = {k for k in set(stored) - set(written) if k.endswith("gate.weight_scale_inv")}
    assert set(written) == set(stored) - routers and len(routers) == (3 if kind == "kimi_linear" else 0)
    for key in (r.removesuffix("_scale_inv") for r in routers):
        np.testing.assert_array_equal(written.pop(key), plain[key])
    for key, got in written.items():
        want = stored[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if want.dtype != ml_dtypes.float8_e4m3fn:
            continue
        values = (got, want)
        scales = (written[key + "_scale_inv"], stored[key + "_scale_inv"])
        if any(m in key for m in ("mlp.", "o_proj", "out_proj")):  # held as the file's transpose
            np.testing.assert_array_equal(values[0].view(np.uint8), values[1].view(np.uint8), err_msg=key)
            np.testing.assert_allclose(scales[0], scales[1], rtol=2.5e-7, err_msg=key)
        else:  # fused or regrouped by head in gdnx: quantized again, within float8's rounding of the file's
            w = [fp8_values(v, s, (16, 24)) for v, s in zip(values, scales)]
            assert relative_error(w[0], w[1]) <= 2 ** -4, key
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [16, 24]
    # modules_to_not_convert as transformers' FP8 quantizer reads it (its GPU path: a module left out of it is an
    # FP8 linear reading float8 values with their factors): exactly the modules written unquantized
    from transformers.quantizers.quantizers_utils import should_convert_module
    modules = {k.removesuffix(".weight") for k in written if k.endswith(".weight")}
    float8 = {m for m in modules if written[m + ".weight"].dtype == ml_dtypes.float8_e4m3fn}
    converted = {m for m in modules if should_convert_module(m, config["modules_to_not_convert"])}
    assert converted == float8, (sorted(converted - float8)[:5], sorted(float8 - converted)[:5])
    toks = tokens(2, 24)
    # Qwen3-Next's regrouped GDN projection rounds to the same values again; Kimi's q|k|v, fused per head,
    # rounds once more on each load (0.4% measured held, 1.1% dequantized: the bound of the load test above)
    tol = 1e-6 if kind == "qwen3_next_moe" else 2e-2
    again = CausalLM.from_pretrained(tmp_path / "out", quantize="fp8")
    assert relative_error(np.asarray(again(toks)), np.asarray(held(toks))) <= tol
    assert relative_error(np.asarray(CausalLM.from_pretrained(tmp_path / "out")(toks)),
                          np.asarray(held(toks))) <= tol
    with pytest.raises(ValueError, match=r"fp8_layout: the model is held 'none', not fp8"):
        CausalLM.from_pretrained(tmp_path / "plain").save_pretrained(tmp_path / "no", fp8_layout=True)


def _read(path):
    """A safetensors file's tensors, float8 included (numpy's reader refuses it)."""
    raw = RawTensors(path)
    dtypes = {**FLOAT8, **FACTORS, "I64": np.int64, "I32": np.int32}
    return {k: raw.get(k, (), dtypes[raw.dtype(k)]) for k in raw.header if k != "__metadata__"}
