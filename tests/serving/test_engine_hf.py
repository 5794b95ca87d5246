"""The engine's greedy tokens equal transformers' generate for ragged
prompts, on tiny random models of every family gdnx loads."""

import numpy as np
import pytest
import torch

from gdnx.serving import Engine, SamplingParams
from tests.hf_models import KINDS, hf_and_gdnx, tokens


@pytest.mark.parametrize("kind,scanned", [(kind, False) for kind in KINDS] + [("qwen3_5", True)])
def test_ragged_prompts_match_transformers_greedy(tmp_path, kind, scanned):
    # weights scaled up so the next-token distribution is peaked (greedy ties
    # between near-equal logits would be about float noise)
    hf, model = hf_and_gdnx(tmp_path, kind, scale=5.0, scan_layers=scanned, gdn_chunk_size=16)
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 20, 9, 30)]
    engine = Engine(model, max_slots=4, max_length=48, block_size=16, decode_steps=4)
    out = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, got in zip(prompts, out):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        np.testing.assert_array_equal(got.tokens, ref[0, len(prompt):].numpy())
