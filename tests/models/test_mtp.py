"""Multi-token prediction modules (mtp.*, model.mtp_num_layers): a
Qwen3-Next (MoE) and a Qwen3.5 (dense) checkpoint with an MTP module, built here (its decoder layer
from one of the model's full-attention layers, perturbed; fc and norms
random), loads it beside the language model and writes it back bit for
bit. Its teacher-forced logits equal an independent reference assembled
from transformers' own pieces (the model's embeddings, final hidden states,
rotary tables, RMSNorm, head, and its decoder layer class holding the MTP
layer's weights), float32 on both sides: 1e-5, as the other parity tests.
Ling 3's layer (DeepSeek's layout, after the decoder's layers) against
transformers' own MTP module and candidate generator."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from gdnx.measure import relative_error
from gdnx.models import CausalLM
from tests.helpers.hf_models import hf_logits, tokens
from tests.helpers.mtp import mtp_checkpoint
from tests.helpers.tiers import fast_only


def _reference(directory, mtp, layer, toks):
    """The MTP logits from transformers' pieces (the MTP layer as the model's
    layer `layer`, written into a copy of the checkpoint and loaded there)."""
    as_layer = directory.parent / "as_layer"
    shutil.copytree(directory, as_layer)
    tensors = load_file(directory / "model.safetensors")
    for k, v in mtp.items():
        if k.startswith("mtp.layers.0."):
            tensors[f"model.layers.{layer}.{k.removeprefix('mtp.layers.0.')}"] = v
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, as_layer / "model.safetensors")
    main = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    holder = transformers.AutoModelForCausalLM.from_pretrained(as_layer, attn_implementation="eager").eval()
    norm_cls = type(main.model.norm)
    eps = main.config.rms_norm_eps

    def norm(name):
        n = norm_cls(main.config.hidden_size, eps=eps)
        n.weight.data = torch.from_numpy(mtp[f"mtp.{name}.weight"])
        return n

    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(toks)).long()
        hidden = main.model(ids).last_hidden_state[:, :-1]
        x = torch.cat([norm("pre_fc_norm_embedding")(main.model.embed_tokens(ids[:, 1:])),
                       norm("pre_fc_norm_hidden")(hidden)], dim=-1)
        x = x @ torch.from_numpy(mtp["mtp.fc.weight"]).T
        t = x.shape[1]
        positions = torch.arange(t)[None]
        rope = main.model.rotary_emb(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = holder.model.layers[layer](x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return main.lm_head(norm("norm")(out)).float().numpy()


@pytest.mark.parametrize("kind", fast_only(["qwen3_next_moe", "qwen3_5"], lambda k: k == "qwen3_5"))
def test_an_mtp_module_loads_computes_as_transformers_pieces_and_is_written_back(hf_checkpoints, tmp_path, kind):
    directory, mtp, layer = mtp_checkpoint(hf_checkpoints.path(kind), tmp_path / "mtp", np.random.default_rng(0))
    model = CausalLM.from_pretrained(directory)
    assert model.config.mtp_num_layers == 1 and model.mtp is not None
    toks = tokens(2, 16)
    got = np.asarray(model.mtp_logits(toks))
    assert got.shape == (2, 15, model.config.vocab_size)
    ref = _reference(directory, mtp, layer, toks)
    assert relative_error(got, ref) <= 1e-5
    # the language model is the one without the module
    plain = CausalLM.from_pretrained(hf_checkpoints.path(kind))
    np.testing.assert_array_equal(np.asarray(model(toks)), np.asarray(plain(toks)))
    # written back: the same tensors, and config.json's mtp_num_hidden_layers
    model.save_pretrained(tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in mtp.items():
        np.testing.assert_array_equal(written[k], v, err_msg=k)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    # and transformers loads the export (its language model; it has no MTP module for these families)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert relative_error(hf_logits(hf, toks), np.asarray(model(toks))) <= 1e-5
    # without the module (mtp_num_layers=0) the tensors are skipped, and asking for its logits says so
    bare = CausalLM.from_pretrained(directory, mtp_num_layers=0)
    with pytest.raises(ValueError, match="model.mtp_num_layers: this model has no multi-token prediction module"):
        bare.mtp_logits(toks)


@pytest.mark.slow
def test_ling_3s_mtp_layer_computes_and_drafts_as_transformers_and_is_written_back(hf_checkpoints, tmp_path):
    """Ling 3's multi-token prediction layer (model.layers.N: enorm, hnorm,
    eh_proj, a latent-attention MoE layer, shared_head.norm), as Ling stores
    it: gdnx loads it (config.json's num_nextn_predict_layers with the
    tensors there), its teacher-forced logits equal transformers' own MTP
    module (MtpModel, loaded from the checkpoint as transformers' candidate
    generator loads it) within 1e-5, float32; the engine's drafts equal the
    drafts of transformers' MTP candidate generator (generate(use_mtp=True))
    where both drafted after the same tokens; and the export holds the
    layer's tensors bit for bit, which transformers' module loads again."""
    from transformers.modeling_layers import MtpModel

    from gdnx.serving import Engine, SamplingParams
    from tests.helpers.mtp import ling_mtp_checkpoint

    directory, mtp = ling_mtp_checkpoint(hf_checkpoints.path("bailing_hybrid"), tmp_path / "mtp",
                                         np.random.default_rng(0))
    model = CausalLM.from_pretrained(directory)
    assert model.config.mtp_num_layers == 1
    toks = tokens(2, 16)

    def reference(path):
        main = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        module = MtpModel.from_pretrained(main).eval()
        with torch.no_grad():
            ids = torch.from_numpy(np.asarray(toks)).long()
            hidden = main.model(ids).last_hidden_state[:, :-1]
            positions = torch.arange(ids.shape[1] - 1)[None].expand(ids.shape[0], -1)
            out = module.forward_layer(0, hidden, positions, None, input_ids=ids[:, 1:])
            return main, module._project_to_logits(out).float().numpy()

    main, ref = reference(directory)
    assert relative_error(np.asarray(model.mtp_logits(toks)), ref) <= 1e-5
    # the drafts of transformers' candidate generator, by the length of the sequence they drafted after
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    theirs: dict[int, int] = {}
    original = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        if out[0].shape[1] > input_ids.shape[1]:
            theirs[input_ids.shape[1]] = int(out[0][0, input_ids.shape[1]])
        return out
    prompt = np.asarray(toks[0, :9]).tolist()
    MTPCandidateGenerator.get_candidates = recording
    try:
        with torch.no_grad():
            generated = main.generate(torch.tensor([prompt]), use_mtp=True, do_sample=False, max_new_tokens=10,
                                      min_new_tokens=10)
    finally:
        MTPCandidateGenerator.get_candidates = original
    engine = Engine(model, max_slots=1, max_length=32, draft_method="mtp", draft_tokens=1)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    ours: dict[int, int] = {}
    out: list[int] = []
    first = True
    while engine.has_unfinished():
        for event in engine.step(decode=not first):  # the first step stops after the prefill: its drafts too
            out += event.tokens
        first = False
        req = engine.scheduler.get(rid)
        if req is not None and req.slot is not None and engine._mtp_proposals.get(req.held_slot):
            ours[len(req.prompt) + len(req.tokens)] = engine._mtp_proposals[req.held_slot][0]
    with torch.no_grad():
        plain = main.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10)
    assert plain[0].tolist() == prompt + out  # the engine's tokens are transformers' greedy ones
    # transformers' MTP-assisted generate on this hybrid leaves its greedy tokens after the first refused draft
    # (the delta-rule layers' states are not rolled back with the refused positions): drafts are compared
    # where its sequence is still the greedy one
    agreed = next((n for n in range(len(prompt), plain.shape[1]) if generated[0, n] != plain[0, n]),
                  plain.shape[1])
    both = sorted(n for n in set(theirs) & set(ours) if n <= agreed)
    assert len(both) >= 2, (theirs, ours, agreed)
    assert [theirs[n] for n in both] == [ours[n] for n in both]
    # written back as Ling stores it; transformers' module loads the export
    model.save_pretrained(tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in mtp.items():
        np.testing.assert_array_equal(written[k], v, err_msg=k)
    _, again = reference(tmp_path / "out")
    assert relative_error(again, ref) <= 1e-6
