"""model.init_from on the 8-device mesh: a gdnx run's weights read into a
quantized model (the base of QLoRA) on an Explicit mesh, laid out as the run
holds its layers or re-laid out (the run unrolled and the model scanned, or
the reverse), each device reading and quantizing its part: the values and
factors placed as the model's shardings say, equal bit for bit to the whole
load."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from gdnx.config import load_config
from gdnx.models import CausalLM
from gdnx.parallel import shardings
from gdnx.training import Trainer, init_from
from tests.parallel.helpers import mesh


@pytest.mark.slow
@pytest.mark.parametrize("run_scan,scan", [(False, False), (False, True), (True, False)],
                         ids=["as-the-run", "run-unrolled-model-scanned", "run-scanned-model-unrolled"])
def test_a_run_read_quantized_onto_an_explicit_mesh_equals_the_whole_load(tmp_path, monkeypatch, run_scan, scan):
    Trainer(load_config("tiny", ["model.hidden_size=32", "model.intermediate_size=64", "train.steps=1",
                                 "train.warmup_steps=0", "train.eval_every=0", "train.checkpoint_every=1",
                                 f"model.scan_layers={str(run_scan).lower()}",
                                 f"train.out_dir={tmp_path / 'run'}"])).run()
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    cfg = init_from.load_train_config("finetune", [
        f"model.init_from={tmp_path / 'run'}", f"data.path={tmp_path / 'prompts.jsonl'}", "model.quantize=int8",
        "model.quantize_block=[16, 16]", f"model.scan_layers={str(scan).lower()}"]).model
    assert cfg.scanned == scan
    m = mesh("explicit", data=2, fsdp=2, tensor=2)
    shapes = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg)), nnx.Param)
    expected = dict(nnx.to_flat_state(shardings(shapes, cfg, m)))
    targets = []  # what each restore was asked to place
    restore = init_from.load_run_params
    monkeypatch.setattr(init_from, "load_run_params", lambda path, target: targets.append(target) or restore(
        path, target))
    sharded = nnx.to_flat_state(init_from.initial_params(cfg, shapes, shardings(shapes, cfg, m)))
    read = [x.sharding for x in jax.tree.leaves(targets.pop())]
    assert sum(x is not None and not x.is_fully_replicated for x in read) > len(read) / 2  # no whole copy first
    whole = dict(nnx.to_flat_state(init_from.initial_params(cfg, shapes, None)))
    assert {p for p, _ in sharded} == whole.keys()
    assert sum(str(p[-1]).endswith("_scale") for p, _ in sharded) > 4
    split = 0
    for path, var in sharded:
        value = var[...]
        assert value.sharding.is_equivalent_to(expected[path], value.ndim), path
        split += not value.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(value), np.asarray(whole[path][...]), err_msg=str(path))
    assert split > len(sharded) / 2
