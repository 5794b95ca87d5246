"""LoRA on a frozen base: only the adapters train and are checkpointed,
the base stays bit for bit; the run exports merged (transformers loads it
and generates what gdnx generates) or as a PEFT adapter (PEFT on the base
gives the merged model's logits)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from flax import nnx
from peft import PeftModel

from gdnx import quantization
from gdnx.export import export_run
from gdnx.generate import generate
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from gdnx.runs import load_run
from gdnx.training import build_trainer
from gdnx.training.init_from import load_train_config
from tests.helpers.hf_models import hf_logits, tokens
from tests.helpers.data import copy_examples


@pytest.fixture(scope="module")
def bases(tmp_path_factory, hf_checkpoints):
    """Tiny random models of each family saved by transformers (Qwen3.5
    splits the GDN input projection in two modules, OLMo Hybrid in four,
    Qwen3-Next keeps it whole), with a chat tokenizer, and SFT examples."""
    root = tmp_path_factory.mktemp("lora")
    for kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear_q_lora", "bailing_hybrid",
                 "lara_mini"):
        (root / kind).symlink_to(hf_checkpoints.path(kind, tokenizer="chat"))
    (root / "sft.jsonl").write_text("".join(json.dumps(e) + "\n" for e in copy_examples(120,
                                                                                         np.random.default_rng(1))))
    return root


def _train(root, kind, out, *extra):
    config = load_train_config("finetune", [
        f"model.init_from={root / kind}", f"data.path={root / 'sft.jsonl'}", "data.seq_len=48", "train.batch_size=4",
        "train.warmup_steps=1", "train.steps=6", "train.eval_every=0", "train.checkpoint_every=6",
        "train.learning_rate=2e-2", f"train.out_dir={out}", "train.lora.rank=4", "train.lora.alpha=8", *extra])
    trainer = build_trainer(config)
    base = jax.tree.map(np.asarray, trainer.frozen)
    trainer.run()
    return trainer, base


def test_only_the_adapters_train_and_are_saved(bases, tmp_path):
    """Scanned, with dropout: the base weights are the checkpoint's bit for
    bit after training, the adapters moved, and the checkpoint and the
    optimizer state hold the adapters alone."""
    trainer, base = _train(bases, "qwen3_5", tmp_path, "model.scan_layers=true", "train.lora.dropout=0.1")
    loaded = CausalLM.from_pretrained(bases / "qwen3_5", scan_layers=True)
    fresh = nnx.to_flat_state(nnx.state(loaded, nnx.Param))
    assert [p for p, _ in fresh] == [p for p, _ in nnx.to_flat_state(trainer.frozen)]
    for (_, a), (_, b) in zip(fresh, nnx.to_flat_state(trainer.frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    jax.tree.map(np.testing.assert_array_equal, base, jax.tree.map(np.asarray, trainer.frozen))
    manager = ocp.CheckpointManager(tmp_path / "checkpoints")
    saved = manager.restore(6, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
    manager.close()
    leaves = jax.tree_util.tree_leaves_with_path(saved)
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    assert leaves and all("'lora_a'" in n or "'lora_b'" in n for n in names), names
    b_leaves = [np.asarray(x) for n, (_, x) in zip(names, leaves) if "'lora_b'" in n]
    assert all(np.abs(x).max() > 0 for x in b_leaves), "an adapter's B stayed at zero"
    run = load_run(tmp_path)
    assert run.step == 6 and run.config.train.lora.dropout == 0.1


@pytest.fixture(scope="module")
def qwen3_5_run(bases, tmp_path_factory):
    """One LoRA run on Qwen3.5 (every projection), exported merged."""
    out = tmp_path_factory.mktemp("qwen3_5_run")
    _train(bases, "qwen3_5", out / "run")
    export_run(out / "run", out / "merged", "merge_lora")
    return out


@nnx.jit
def _forward(model, toks):
    return model(toks)


def _gdnx_logits(model, toks):
    return np.asarray(_forward(model, jnp.asarray(toks, jnp.int32)))


@pytest.mark.slow
def test_merged_export_generates_what_gdnx_generates(bases, qwen3_5_run):
    run = load_run(qwen3_5_run / "run")
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_5_run / "merged").eval()
    toks = tokens(2, 20)
    ours = _gdnx_logits(run.model, toks)
    assert relative_error(hf_logits(hf, toks), ours) <= 1e-4
    base = _gdnx_logits(CausalLM.from_pretrained(bases / "qwen3_5"), toks)
    assert relative_error(base, ours) > 1e-2, "the adapters changed nothing: the comparison would not see them"
    prompt = toks[:1, :8]
    want = np.asarray(generate(run.model, jnp.asarray(prompt, jnp.int32), 12))
    with torch.no_grad():
        got = hf.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0).numpy()
    np.testing.assert_array_equal(got[:, 8:], want[:, -12:])
    assert (qwen3_5_run / "merged" / "tokenizer_config.json").is_file()


# the modules PEFT adapts for the GDN input projection, per family
_SPLIT = {"qwen3_5": ("in_proj_qkv", "in_proj_z"), "olmo_hybrid": ("q_proj", "k_proj", "v_proj", "g_proj"),
          "qwen3_next": ("in_proj_qkvz",), "kimi_linear_q_lora": ("q_proj", "k_proj", "v_proj"),
          "bailing_hybrid": ("q_proj", "k_proj", "v_proj"),
          # Lara 4 Mini's files fuse one in_proj; transformers splits it in memory as Qwen3.5's
          "lara_mini": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
# where the family's projections live (Kimi Linear's and Ling's KDA and latent attention under self_attn)
_MIXER = {"kimi_linear_q_lora": "self_attn", "bailing_hybrid": "self_attn"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", _SPLIT)
def test_peft_on_the_base_gives_the_merged_logits(bases, qwen3_5_run, tmp_path, kind):
    if kind == "qwen3_5":
        run, merged_dir = qwen3_5_run / "run", qwen3_5_run / "merged"
    else:
        # PEFT moves a qwen3_next adapter's MLP targets onto the routed experts (tests/checkpoints/test_peft.py)
        targets = ["train.lora.targets=[in_proj_qkvz, in_proj_ba, out_proj, q_proj, k_proj, v_proj, o_proj]"]
        run, merged_dir = tmp_path / "run", tmp_path / "merged"
        _train(bases, kind, run, *(targets if kind == "qwen3_next" else []))
        export_run(run, merged_dir, "merge_lora")
    export_run(run, tmp_path / "adapter", "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert all(f"{_MIXER.get(kind, 'linear_attn')}.{m}" in config["target_modules"].replace("\\", "")
               for m in _SPLIT[kind])
    base = transformers.AutoModelForCausalLM.from_pretrained(bases / kind).eval()
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    toks = tokens(2, 20)
    assert relative_error(hf_logits(adapted, toks), hf_logits(merged, toks)) <= 1e-5


@pytest.mark.slow
def test_expert_adapters_merge_and_are_refused_as_peft(bases, tmp_path):
    _train(bases, "qwen3_5_moe", tmp_path / "run", "train.lora.targets=[experts, q_proj, in_proj_qkvz]")
    run = load_run(tmp_path / "run")
    export_run(tmp_path / "run", tmp_path / "merged", "merge_lora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    toks = tokens(2, 20)
    assert relative_error(hf_logits(hf, toks), _gdnx_logits(run.model, toks)) <= 1e-4
    with pytest.raises(ValueError, match="--adapter: the run's adapters include the routed experts"):
        export_run(tmp_path / "run", tmp_path / "adapter", "adapter")
    with pytest.raises(ValueError, match="the run trained LoRA adapters on a frozen base"):
        export_run(tmp_path / "run", tmp_path / "plain", "model")


def test_a_changed_base_is_refused_on_resume_export_and_load(bases, tmp_path):
    """The run records its base's fingerprint; once the base's weights
    change, resuming, exporting and loading the run are refused naming
    model.init_from (the adapters were trained on the old weights)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(bases / "qwen3_5", base)
    root = tmp_path / "root"
    root.mkdir()
    (root / "qwen3_5").symlink_to(base)
    (root / "sft.jsonl").symlink_to(bases / "sft.jsonl")
    _train(root, "qwen3_5", tmp_path / "run")
    assert load_run(tmp_path / "run").step == 6  # unchanged base: fine
    weights = load_file(base / "model.safetensors")
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name] = weights[name] * 1.5
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    for attempt in (lambda: _train(root, "qwen3_5", tmp_path / "run", "train.steps=8"),
                    lambda: export_run(tmp_path / "run", tmp_path / "merged", "merge_lora"),
                    lambda: load_run(tmp_path / "run")):
        with pytest.raises(ValueError, match=r"model.init_from: .* changed since the LoRA run"):
            attempt()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int4"])
def test_lora_on_a_quantized_base_trains_resumes_and_exports_merged(bases, tmp_path, kind):
    """QLoRA: adapters (on the experts and two projections) over a base held
    quantized (model.quantize); the quantized base stays bit for bit, the
    run resumes, and the merged export (the base dequantized, the adapters
    merged in) is what the run computes under transformers."""
    over = [f"model.quantize={kind}", "model.quantize_block=[16, 24]",
            "train.lora.targets=[experts, q_proj, in_proj_qkvz]"]
    trainer, base = _train(bases, "qwen3_5_moe", tmp_path / "run", *over)
    assert any(x.dtype == quantization.DTYPES[kind] for x in jax.tree.leaves(base))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8)),
                 base, jax.tree.map(np.asarray, trainer.frozen))
    _train(bases, "qwen3_5_moe", tmp_path / "run", *over, "train.steps=7")  # resumes from step 6
    run = load_run(tmp_path / "run")
    assert run.step == 7
    export_run(tmp_path / "run", tmp_path / "merged", "merge_lora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    toks = tokens(2, 20)
    assert relative_error(hf_logits(hf, toks), _gdnx_logits(run.model, toks)) <= 1e-5
    # merged and written back as FP8 (blocks of 16 x 24): within float8's rounding of the merged model
    export_run(tmp_path / "run", tmp_path / "merged_fp8", "merge_lora", fp8=True)
    config = json.loads((tmp_path / "merged_fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 24]
    fp8 = CausalLM.from_pretrained(tmp_path / "merged_fp8")
    assert relative_error(_gdnx_logits(fp8, toks), hf_logits(hf, toks)) <= 0.05


@pytest.mark.slow
def test_adapters_on_the_mtp_module_train_with_its_loss_and_merge(bases, tmp_path):
    """train.lora.mtp: the multi-token prediction module's layer gets
    adapters, which its loss trains (mtp_loss_1 in the metrics) and the
    merged export carries (its mtp.* weights moved, the rest of the module
    as the base had it); without it the module stays frozen and unscored."""
    from safetensors.numpy import load_file

    from tests.helpers.mtp import mtp_checkpoint

    base, mtp, _ = mtp_checkpoint(bases / "qwen3_5", tmp_path / "base", np.random.default_rng(0))
    (bases / "qwen3_5_mtp").symlink_to(base)
    trainer, _ = _train(bases, "qwen3_5_mtp", tmp_path / "run", "train.lora.mtp=true")
    adapted = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(trainer.params)
               if "'mtp'" in jax.tree_util.keystr(p)]
    assert adapted and all("lora" in n for n in adapted)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("mtp_loss_1" in m for m in metrics)
    export_run(tmp_path / "run", tmp_path / "merged", "merge_lora")
    written = load_file(tmp_path / "merged" / "model.safetensors")
    moved = [k for k, v in mtp.items() if not np.array_equal(written[k], v)]
    assert "mtp.layers.0.self_attn.q_proj.weight" in moved and "mtp.fc.weight" not in moved, moved
    from gdnx.layers.lora import AdapterSpec

    cfg = trainer.config.model
    without = nnx.eval_shape(lambda: CausalLM(cfg, adapters=AdapterSpec(4, 8.0, 0.0, frozenset({"q_proj"}))))
    assert not [p for p, _ in nnx.to_flat_state(nnx.state(without, nnx.LoRAParam)) if p[0] == "mtp"]


@pytest.mark.slow
def test_glm5_next_sft_lora_exports_merged_and_as_peft(hf_checkpoints, bases, tmp_path):
    """GLM-5-Next (packed SFT rows: each document indexed on its own;
    scanned): LoRA on its KDA, latent attention and MLP projections trains; the merged
    export (carrying the source's vision tower) loads in transformers with
    gdnx's logits, and the PEFT adapter on the base gives the merged
    logits (the KDA gate's low-rank projections under transformers'
    in-memory names)."""
    base_dir = hf_checkpoints.path("glm5_next", tokenizer="chat")
    (bases / "glm5_next").symlink_to(base_dir)
    _train(bases, "glm5_next", tmp_path / "run", "model.scan_layers=true",
           "train.lora.targets=[q_proj, k_proj, v_proj, o_proj, f_a_proj, q_b_proj, kv_b_proj, gate_proj]")
    targets = _exports_match(tmp_path, base_dir, transformers.Glm5NextForConditionalGeneration)
    assert "forget_gate.f_a_proj" in targets


@pytest.mark.slow
def test_qwen4_exp_sft_lora_exports_merged_and_as_peft(hf_checkpoints, bases, tmp_path):
    """Qwen4-Exp (packed SFT rows: each document's n-grams, PLE convolution
    and blocks on their own): LoRA on its GDN and gated attention trains;
    the merged export (carrying the source's vision tower) loads in
    transformers with gdnx's logits, and the PEFT adapter on the base gives
    the merged logits (the GDN input projection as Qwen3.5's two modules)."""
    base_dir = hf_checkpoints.path("qwen4_exp", tokenizer="chat")
    (bases / "qwen4_exp").symlink_to(base_dir)
    _train(bases, "qwen4_exp", tmp_path / "run",
           "train.lora.targets=[in_proj_qkvz, in_proj_ba, out_proj, q_proj, k_proj, v_proj, o_proj]")
    targets = _exports_match(tmp_path, base_dir, transformers.Qwen4ExpForConditionalGeneration)
    assert all(f"linear_attn.{m}" in targets for m in ("in_proj_qkv", "in_proj_z"))


def _exports_match(tmp_path, base_dir, cls) -> str:
    """The run under tmp_path exported merged and as a PEFT adapter: the
    merged export, loaded by transformers' `cls`, gives gdnx's logits
    (1e-4), which the adapters changed from the base's (transformers' own:
    the family's parity tests hold gdnx's base to them); PEFT on the base
    gives the merged logits (1e-5). Returns the adapter's target modules."""
    export_run(tmp_path / "run", tmp_path / "merged", "merge_lora")
    export_run(tmp_path / "run", tmp_path / "adapter", "adapter")
    merged = cls.from_pretrained(tmp_path / "merged").eval()
    toks = tokens(2, 20)
    ours = _gdnx_logits(load_run(tmp_path / "run").model, toks)
    assert relative_error(hf_logits(merged, toks), ours) <= 1e-4
    base = cls.from_pretrained(base_dir).eval()
    assert relative_error(hf_logits(base, toks), ours) > 1e-3
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert relative_error(hf_logits(adapted, toks), hf_logits(merged, toks)) <= 1e-5
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    return config["target_modules"].replace("\\", "")
