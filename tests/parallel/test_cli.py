"""`gdnx generate` with parallel.* overrides: the model loaded onto a mesh
of this host's 8 devices (each device reading its part of the files), the
batched engine's results and the single prompt's stream equal to one
device's; a mesh the engine cannot use is one line."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.cli import main
from gdnx.generate import generate
from tests.helpers.hf_models import VOCAB, words
from tests.helpers.cli import refused


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints):
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next", scale=5.0, tokenizer="words", gdn_chunk_size=16)
    return hf_checkpoints.path("qwen3_next", scale=5.0, tokenizer="words"), model


@pytest.mark.slow
def test_generate_on_a_mesh_gives_the_one_device_tokens(checkpoint, tmp_path, capsys):
    path, model = checkpoint
    rng = np.random.default_rng(1)
    shared = rng.integers(1, VOCAB, 70).tolist()  # more than one block (4 chunks of 16)
    prompts = [shared + [3], rng.integers(1, VOCAB, 7).tolist(), shared + [9, 4]]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": words(p), "logprobs": 1}) for p in prompts) + "\n")
    plain = [np.asarray(generate(model, jnp.asarray([p]), 6))[0].tolist() for p in prompts]
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(src), "--out", str(out),
                 "--max-new-tokens", "6", "--max-slots", "2", "--prefix-cache-mb", "16", "--speculative", "2",
                 "model.gdn_chunk_size=16", "parallel.data=2", "parallel.tensor=4"]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["tokens"] for g in got] == plain
    assert got[2]["cached_tokens"] == 64
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(path), "--prompt", words(prompts[1]), "--max-new-tokens", "6",
                 "--temperature", "0", "model.gdn_chunk_size=16", "parallel.tensor=2", "parallel.context=2"]) == 0
    assert capsys.readouterr().out.split() == [f"w{t}" for t in plain[1]]


@pytest.mark.parametrize("overrides,match", [
    (["parallel.context=2", "parallel.tensor=4"], "parallel: the engine splits heads and slots, not sequences"),
    (["parallel.tensor=3"], "parallel: data x fsdp x expert x tensor x context = 3, but there are 8 devices"),
    (["parallel.tensor=0"], "parallel.tensor: "),
    (["train.steps=3"], "train: generate takes model.\\* and parallel.\\* overrides only"),
])
def test_a_mesh_the_command_cannot_use_is_one_line(checkpoint, tmp_path, capsys, overrides, match):
    path, _ = checkpoint
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    line = refused(capsys, ["generate", "--checkpoint", str(path), "--prompts-file", str(src), "--out",
                           str(tmp_path / "out.jsonl"), "--max-new-tokens", "2", "parallel.data=1", *overrides])
    assert re.search(match, line), line


@pytest.mark.slow
def test_eval_on_a_mesh_gives_the_one_device_numbers(tmp_path, capsys):
    """gdnx eval with parallel.*: the scoring on a data x tensor mesh gives
    one device's per-sample log-likelihoods (1e-5 relative, float32)."""
    pytest.importorskip("lm_eval")
    from tests.helpers.evaluation import first_logprob, read_samples, write_model_and_tasks

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        path, tasks = write_model_and_tasks(tmp_path)
        got = {}
        for name, overrides in (("one", []), ("mesh", ["parallel.data=2", "parallel.tensor=4"])):
            assert main(["eval", "--checkpoint", str(path), "--tasks", "tiny_mc,tiny_ppl", "--include-path",
                         str(tasks), "--batch-size", "4", "--output-path", str(tmp_path / name), "--log-samples",
                         *overrides]) == 0
            got[name] = {t: [first_logprob(r) for s in read_samples(tmp_path / name, t) for r in s["resps"]]
                         for t in ("tiny_mc", "tiny_ppl")}
    capsys.readouterr()
    for task in ("tiny_mc", "tiny_ppl"):
        np.testing.assert_allclose(got["mesh"][task], got["one"][task], rtol=1e-5)
