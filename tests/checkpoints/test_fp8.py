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

import numpy as np
import pytest
import transformers
from safetensors.numpy import save_file

from gdnx.measure import relative_error
from gdnx.models import CausalLM
from tests.helpers.fp8 import fp8_checkpoint
from tests.helpers.hf_models import KINDS, hf_logits, tokens

# every family; blocks that do not divide the tiny matrices (partial edges) and every factor format
CASES = [("qwen3_next_moe", (16, 24), "float32"), ("qwen3_5", (128, 128), "float32"),
         ("qwen3_5_moe", (16, 16), "ue8m0"), ("olmo_hybrid", (32, 12), "bfloat16"),
         ("kimi_linear", (16, 24), "ue8m0"), ("bailing_hybrid", (8, 16), "float32"),
         ("lara_mini", (16, 16), "bfloat16")]


@pytest.mark.parametrize("kind, block, factors", CASES, ids=[c[0] for c in CASES])
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
