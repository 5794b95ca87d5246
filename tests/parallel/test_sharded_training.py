"""Training on a mesh: the same losses as on one device step by step, and a
sharded run that checkpoints and resumes into sharded arrays."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.config.reading import load_config
from gdnx.measure import relative_error
from gdnx.training import Trainer, train
from tests.parallel.helpers import mesh
from tests.helpers.configs import SMALL_RUN
from tests.parallel.helpers import losses, max_relative

# 4 key heads so that tensor=2 splits them; batch 8 over data=4
SHARDABLE = SMALL_RUN + ["model.linear_num_key_heads=4", "model.linear_num_value_heads=4",
                     "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "train.batch_size=8",
                     "model.gdn_chunk_size=16"]



@pytest.mark.slow
def test_sharded_steps_and_gradient_accumulation_give_the_single_device_losses():
    """Whole-batch steps on a data x tensor x context mesh, and micro-batches
    of the sharded batch (2 of 4 rows over data=2) in both shard modes: the
    losses of whole-batch steps on one device."""
    cfg = load_config("tiny", SHARDABLE + ["train.steps=8"])
    one = losses(Trainer(cfg))
    sharded = losses(Trainer(cfg, mesh=mesh("explicit", data=2, tensor=2, context=2)))
    # each step's loss within 1e-5 relative: float32 sums split over shards
    # and added in another order drift by ~1e-7 per step over 8 steps
    assert max_relative(sharded, one) <= 1e-5
    accumulated = load_config("tiny", SHARDABLE + ["train.steps=8", "train.grad_accum_steps=2"])
    for mode in ("auto", "explicit"):
        sharded = losses(Trainer(accumulated, mesh=mesh(mode, data=2, tensor=2, context=2)))
        assert max_relative(sharded, one) <= 1e-5  # as above: float32 sums in another order


@pytest.mark.slow
def test_train_on_a_mesh_checkpoints_and_resumes(tmp_path):
    over = SHARDABLE + [f"train.out_dir={tmp_path}", "train.checkpoint_every=2", "parallel.tensor=2",
                        "parallel.shard_mode=explicit"]
    first = train(load_config("tiny", over + ["train.steps=4"]))
    assert first["step"] == 4
    resumed = train(load_config("tiny", over + ["train.steps=6"]))
    assert resumed["step"] == 6
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "train"]
    assert steps == [2, 4, 6]


@pytest.mark.slow
def test_packed_text_rows_on_a_mesh_give_the_single_device_losses(tmp_path):
    """Host-read packed rows placed on a data x tensor mesh (each row block on
    its devices) train as on one device, in both shard modes."""
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": f"document {i} " * (i % 6 + 1)})
                                                for i in range(400)))
    over = SHARDABLE + ["data.source=text", f"data.path={tmp_path / 'c.jsonl'}", "model.vocab_size=256",
                        f"train.out_dir={tmp_path / 'run'}", "train.steps=8"]
    one = losses(Trainer(load_config("tiny", over)))
    for mode in ("auto", "explicit"):
        sharded = losses(Trainer(load_config("tiny", over), mesh=mesh(mode, data=4, tensor=2)))
        assert max_relative(sharded, one) <= 1e-5  # as above: float32 sums in another order


@pytest.mark.slow
def test_scanned_training_on_a_mesh_matches_the_unrolled_stack():
    """Three AdamW steps on a data x tensor x context mesh (Explicit), the
    two GDN layers scanned or unrolled: the same losses and parameters
    (1e-6 relative over all parameters, float32; measured 2e-8). Weight
    decay and the optimizer's moments see each stacked parameter as its
    layers' (norms undecayed, moments sharded as the parameters)."""
    from tests.helpers.models import unrolled_view

    m = mesh("explicit", data=2, tensor=2, context=2)
    out = {}
    for scan in ("false", "true"):
        trainer = Trainer(load_config("tiny", SHARDABLE + ["train.steps=8", "train.warmup_steps=0",
                                                           f"model.scan_layers={scan}"]), mesh=m)
        params, opt = trainer.params, trainer.init_opt_state(trainer.params)
        losses = []
        for s in range(3):
            params, opt, metrics = trainer.step(params, opt, jnp.int32(s))
            losses.append(float(metrics["loss"]))
        view = unrolled_view(nnx.merge(trainer.graphdef, jax.device_get(params)))
        out[scan] = np.array(losses), view
    (ref_losses, ref), (losses, got) = out["false"], out["true"]
    assert max_relative(losses, ref_losses) <= 1e-6
    flat = [np.concatenate([np.ravel(g[p]) for p in ref]) for g in (got, ref)]
    assert relative_error(*flat) <= 1e-6
