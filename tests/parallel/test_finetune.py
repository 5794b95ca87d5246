"""Fine-tuning on a mesh: a Hugging Face checkpoint read straight into its
shardings, trained on SFT data in full or with LoRA adapters (sharded like
their projections, both shard modes): the losses of the same steps on one
device."""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from gdnx.training import Trainer
from gdnx.training.init_from import load_train_config
from tests.parallel.helpers import mesh
from tests.parallel.helpers import losses, max_relative

# one worker builds the checkpoint (a transformers save in a child process) for both cases
pytestmark = [pytest.mark.xdist_group("finetune"), pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5 saved by transformers (in a child process:
    this one stays without torch) with a chat tokenizer, and SFT examples."""
    root = tmp_path_factory.mktemp("finetune")
    script = ("import json, sys, numpy as np\n"
              "from tests.helpers.hf_models import random_hf_model, write_chat_tokenizer\n"
              "from tests.helpers.data import copy_examples\n"
              "random_hf_model('qwen3_5').save_pretrained(sys.argv[1] + '/hf')\n"
              "write_chat_tokenizer(sys.argv[1] + '/hf')\n"
              "lines = [json.dumps(e) for e in copy_examples(120, np.random.default_rng(2))]\n"
              "open(sys.argv[1] + '/sft.jsonl', 'w').write('\\n'.join(lines) + '\\n')\n")
    subprocess.run([sys.executable, "-c", script, str(root)], check=True, timeout=300,
                   cwd=Path(__file__).resolve().parents[2])
    return root


def _config(root, out, *extra):
    return load_train_config("finetune", [
        f"model.init_from={root / 'hf'}", f"data.path={root / 'sft.jsonl'}", "data.seq_len=32", "train.batch_size=8",
        "train.warmup_steps=1", "train.steps=3", "train.learning_rate=1e-2", f"train.out_dir={out}", *extra])


_ONE_DEVICE: dict[bool, np.ndarray] = {}  # the single-device losses, per LoRA or not


@pytest.mark.parametrize("lora, mode, axes", [
    (False, "auto", dict(data=1, fsdp=4, tensor=2)),
    (True, "explicit", dict(data=2, fsdp=2, tensor=2)),
], ids=["full_auto_f4t2", "lora_explicit_d2f2t2"])
def test_fine_tuning_on_a_mesh_gives_the_single_device_losses(checkpoint, tmp_path, lora, mode, axes):
    extra = ["train.lora.rank=4", "train.lora.targets=[in_proj_qkvz, out_proj, q_proj, o_proj, gate_proj, "
             "down_proj]"] if lora else []
    config = _config(checkpoint, tmp_path, *extra)
    if lora not in _ONE_DEVICE:
        _ONE_DEVICE[lora] = losses(Trainer(config))
    one = _ONE_DEVICE[lora]
    sharded = Trainer(config, mesh=mesh(mode, **axes))
    if lora:  # the base weights sharded as they were read, the adapters like their projections
        assert sharded.frozen is not None
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded.frozen))
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded.params))
    # float32 sums split over shards and added in another order (as the
    # sharded training tests); a loss moves ~1e-7 relative per step
    assert max_relative(losses(sharded), one) <= 1e-5
