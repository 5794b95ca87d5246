"""`gdnx export` of a text run: the tokenizer it was trained with travels
with the weights; what it refuses."""

import json

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gdnx.config import load_config
from gdnx.export import export_run
from gdnx.training import train
from tests.helpers.configs import SMALL_RUN


def test_a_text_run_exports_with_its_tokenizer(tmp_path):
    tok = Tokenizer(WordLevel(vocab={"[UNK]": 0, "</s>": 1, **{f"w{i}": 2 + i for i in range(30)}},
                              unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(f"w{(i + j) % 30}" for j in range(12))}) + "\n"
                              for i in range(40)))
    run = tmp_path / "run"
    train(load_config("tiny", SMALL_RUN + ["data.source=text", f"data.path={corpus}",
                                       f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}", "train.steps=3",
                                       "train.eval_every=0", f"train.out_dir={run}"]))
    step, notes = export_run(run, tmp_path / "hf")
    assert step == 3 and notes == []
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode("w3 w4").ids == [5, 6]
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}


def test_what_export_refuses(tmp_path):
    with pytest.raises(ValueError, match="not a gdnx training run"):
        export_run(tmp_path, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ValueError, match="--out .*taken: exists and is not an empty directory"):
        export_run(tmp_path, tmp_path / "taken")
    with pytest.raises(ValueError, match="--fp8: an adapter is written as PEFT stores it"):
        export_run(tmp_path, tmp_path / "out", "adapter", fp8=True)
