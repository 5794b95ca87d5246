"""`gdnx train` with data.source=rl on the tiny model (bytes): the
completions drawn by the engine on the trainer's weights, the metrics of
every step, a resumed run equal to an uninterrupted one, evaluation on
held-out prompts, and the inputs refused before anything is built."""

import json
import subprocess

import numpy as np
import pytest

from gdnx.config import load_config
from gdnx.training import build_trainer, train
from gdnx.training.init_from import load_train_config
from tests.helpers.processes import cpu_env, gdnx
from tests.helpers.rl import RUN


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rl_run_learns_reports_and_resumes(tmp_path, rl_prompts):
    """Four steps, two updates per rollout, evaluated every two: every step
    logs the rewards, lengths, the sampler/trainer gap (float32 rounding
    between the engine's recurrent decode and the trainer's chunked pass:
    under 1e-4) and the time split; a run stopped at step 2 and resumed
    logs the uninterrupted run's steps 3 and 4 exactly."""
    base = RUN + [f"data.path={rl_prompts}", "train.rl.updates_per_rollout=2", "train.checkpoint_every=2",
                  "train.eval_every=2", "data.val_fraction=0.2"]
    whole = tmp_path / "whole"
    result = train(load_config("tiny", base + ["train.steps=4", f"train.out_dir={whole}"]))
    assert result["step"] == 4 and 0.0 <= result["reward"]
    rows = [r for r in _rows(whole) if r["split"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rl/logp_diff_max"] < 1e-4 and r["rl/logp_diff_mean"] <= r["rl/logp_diff_max"]
        assert 1 <= r["rl/completion_length_mean"] <= 4 and r["rl/time_rollout_s"] > 0 and r["rl/time_update_s"] > 0
        assert r["skipped"] == 0.0 and np.isfinite(r["loss"])
    # the second update of a rollout: the same completions, the ratio moved off 1 by the first update
    assert rows[1]["rl/reward_mean"] == rows[0]["rl/reward_mean"] and rows[1]["rl/ratio_mean"] != 1.0
    assert rows[0]["rl/ratio_mean"] == 1.0 and any(r["grad_norm"] > 0 for r in rows)
    evals = [r for r in _rows(whole) if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and {"reward", "accuracy"} <= set(evals[0])

    split = tmp_path / "split"
    train(load_config("tiny", base + ["train.steps=2", f"train.out_dir={split}"]))
    train(load_config("tiny", base + ["train.steps=4", f"train.out_dir={split}"]))
    again = [r for r in _rows(split) if r["split"] == "train"]
    for a, b in zip(rows[2:], again[2:], strict=True):
        for key in ("loss", "grad_norm", "rl/reward_mean", "rl/logp_diff_max", "rl/completion_length_mean"):
            assert a[key] == b[key], key


def test_bitwise_mode_has_the_samplers_log_probabilities_exactly(tmp_path, rl_prompts):
    """train.rl.bitwise: the trainer replays the engine's computation, so
    the gap is exactly 0 at every rollout, and a rollout's first update has
    ratio 1 and no importance correction; its second update's ratio is the
    replay on the updated weights against the sampler's. Two micro-batches
    per update; prompts of 35 tokens (blocks of 16) whose first two blocks
    the completions after the first take from the prefix cache."""
    out, long = tmp_path / "bitwise", tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt": f"Answer in lowercase letters. say {c}:", "answer": c}) + "\n"
                            for c in "abcdefgh"))
    train(load_config("tiny", RUN + [f"data.path={long}", "train.rl.bitwise=true", "train.steps=4",
                                     "data.seq_len=48", "model.gdn_chunk_size=16",
                                     "train.rl.updates_per_rollout=2", "train.checkpoint_every=2",
                                     "train.grad_accum_steps=2", "train.eval_every=0", f"train.out_dir={out}"]))
    rows = [r for r in _rows(out) if r["split"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rl/logp_diff_max"] == 0.0 and r["rl/logp_diff_mean"] == 0.0 and np.isfinite(r["loss"])
        # the four completions' prompts begin with the same 32 tokens: the first prefills them, the rest restore them
        assert r["rl/cached_prompt_tokens"] == 3 * 32
    for first, second in (rows[0:2], rows[2:4]):
        assert first["rl/ratio_mean"] == 1.0 and first["rl/importance_weight_mean"] == 1.0
        assert np.isfinite(second["rl/ratio_mean"]) and second["rl/ratio_mean"] != 1.0
    assert any(r["grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_lora_rl_with_kl_to_the_base(tmp_path, rl_prompts):
    """QLoRA: adapters over a run's weights (model.init_from) held in int8,
    DAPO, KL to the quantized base with its adapters off: 0 on the first
    step (the adapters start as the identity), then above 0 as they move.
    (LoRA over a float base: the reference checkpoint's test below.)"""
    base = tmp_path / "base"
    train(load_config("tiny", ["model.hidden_size=32", "model.intermediate_size=32", "train.steps=1",
                               "train.warmup_steps=0", "train.eval_every=0", "train.checkpoint_every=1",
                               f"train.out_dir={base}"]))
    out = tmp_path / "lora"
    train(load_train_config("finetune", [o for o in RUN if not o.startswith("model.")] + [
        f"model.init_from={base}", "model.quantize=int8", f"data.path={rl_prompts}", "train.lora.rank=4",
        "train.rl.kl_coef=0.1", "train.rl.loss=dapo", "train.batch_size=8", "train.rl.group_size=4",
        "train.rl.max_new_tokens=8", "train.steps=3", "train.eval_every=0", f"train.out_dir={out}"]))
    rows = [r for r in _rows(out) if r["split"] == "train"]
    assert rows[0]["rl/kl"] == 0.0 and rows[-1]["rl/kl"] > 0.0 and rows[0]["rl/groups_kept"] > 0


@pytest.mark.slow
def test_kl_to_a_reference_checkpoint(tmp_path, rl_prompts):
    """train.rl.reference: the KL term's reference read from another run
    (another seed's weights), with and without LoRA: the KL is above 0 from
    the first step, where the initial weights' reference gives 0 (above)."""
    bases = []
    for seed in (0, 1):
        bases.append(tmp_path / f"base{seed}")
        train(load_config("tiny", ["model.hidden_size=32", "model.intermediate_size=32", "train.steps=1",
                                   "train.warmup_steps=0", "train.eval_every=0", "train.checkpoint_every=1",
                                   f"train.seed={seed}", f"train.out_dir={bases[-1]}"]))
    for lora in ([], ["train.lora.rank=4"]):
        out = tmp_path / f"rl{len(lora)}"
        train(load_train_config("finetune", [o for o in RUN if not o.startswith("model.")] + [
            f"model.init_from={bases[0]}", f"data.path={rl_prompts}", *lora, "train.rl.kl_coef=0.1",
            f"train.rl.reference={bases[1]}", "train.steps=1", "train.eval_every=0", f"train.out_dir={out}"]))
        (row,) = [r for r in _rows(out) if r["split"] == "train"]
        assert row["rl/kl"] > 0.0 and np.isfinite(row["loss"]), (lora, row["rl/kl"])


@pytest.mark.parametrize("override,message", [
    (["train.rl.group_size=1"], "train.rl.group_size"),
    (["train.batch_size=6", "train.rl.group_size=4"], "train.batch_size: the completions of a step"),
    (["data.seq_len=8"], "data.seq_len: the prompt at .* is 6 tokens"),
    (["train.rl.reward=exact", "data.path=NOANSWER"], "no \"answer\", which train.rl.reward reads"),
    (["train.rl.reward=no_module_here:f"], "train.rl.reward: cannot import no_module_here"),
    (["train.rl=null"], "train.rl: reinforcement learning takes data.source=rl and a train.rl section together"),
    (["train.rl.updates_per_rollout=3", "train.checkpoint_every=4"], "train.checkpoint_every: a checkpoint falls"),
    (["train.rl.updates_per_rollout=3", "train.checkpoint_every=3", "train.steps=10"],
     "train.steps: the run ends between rollouts"),
    (["train.rl.reference=NOANSWER"], "train.rl.reference: only the KL term reads it"),
    (["train.rl.kl_coef=0.1", "train.rl.reference=NOANSWER"], "train.rl.reference .*: neither a Hugging Face"),
])
def test_bad_rl_inputs_are_refused_naming_the_field(tmp_path, rl_prompts, override, message):
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "hello"}) + "\n")
    override = [o.replace("NOANSWER", str(bare)) for o in override]
    with pytest.raises(ValueError, match=message):
        build_trainer(load_config("tiny", RUN + [f"data.path={rl_prompts}", "train.eval_every=0",
                                                 f"train.out_dir={tmp_path / 'run'}"] + override))


def test_cli_refuses_a_bad_rl_input_in_one_line(tmp_path, rl_prompts):
    out = subprocess.run(gdnx("train", "tiny", *RUN, f"data.path={rl_prompts}", "train.rl.reward=no_module_here:f",
                              f"train.out_dir={tmp_path / 'run'}"), capture_output=True, text=True, env=cpu_env(),
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "train.rl.reward: cannot import no_module_here" in out.stderr
