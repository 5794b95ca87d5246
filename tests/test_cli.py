"""The `gdnx` command: every user error is one line on stderr and exit
status 2, nothing written before is touched; generate from a gdnx run and
from a Hugging Face directory."""

import json

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gdnx.cli import main
from tests.hf_models import VOCAB, hf_and_gdnx
from tests.test_train import SMALL


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,expected", [
    (["train", "model.hidden_sise=8"], "gdnx train: error: model.hidden_sise: unknown key"),
    (["train", "tiny", "train.steps=-3"], "gdnx train: error: train.steps: Input should be greater than 0"),
    (["train", "tiny", "model.gdn_chunk_size=48"], "gdnx train: error: model.gdn_chunk_size: expected one of"),
    (["train", "missing.yml"], "gdnx train: error: config 'missing.yml': no such file"),
    (["train", "tiny", "data.source=text", "data.path=/no/such.txt"], "gdnx train: error: data.path: no such file"),
    (["train", "tiny", "model.gdn_interpret=false"], "gdnx train: error: model.gdn_interpret: false compiles"),
    (["generate", "--checkpoint", "/no/such/dir", "--prompt", "1 2"], "gdnx generate: error: --checkpoint: no such"),
    (["generate", "--checkpoint", ".", "--prompt", "1", "--temperature", "-1"],
     "gdnx generate: error: --temperature: expected >= 0"),
    (["bench", "--seq-len", "0"], "gdnx bench: error: --seq-len: expected a positive integer"),
    (["train", "tiny", "parallel.tensor=2"], "gdnx train: error: parallel: the fixed axis sizes multiply to 2"),
    (["train", "tiny", "parallel.context=0"], "gdnx train: error: parallel.context: expected a positive axis size"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert _error(capsys, argv).startswith(expected)
    assert not (tmp_path / "runs").exists()  # nothing written for a refused run


def test_checkpoint_of_another_config_is_refused_and_left_alone(capsys, tmp_path):
    out = f"train.out_dir={tmp_path}"
    assert main(["train", "tiny", *SMALL, "train.steps=3", "train.checkpoint_every=3", out]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    err = _error(capsys, ["train", "tiny", *SMALL, "model.hidden_size=48", "train.steps=3", out])
    assert "holds checkpoints of another config" in err and "model.hidden_size: 32 there, 48 here" in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    # generate from that run: MQAR prompts are token ids
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "1 17 2 18 1", "--max-new-tokens", "3"]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 3 and all(0 <= int(t) < 32 for t in printed)
    err = _error(capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", "hello"])
    assert "--prompt: this model was trained on MQAR" in err


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "olmo_hybrid"])
def test_generate_from_a_hugging_face_directory(capsys, tmp_path, kind):
    hf_and_gdnx(tmp_path, kind)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "w1 w5 w9", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--top-p", "0.9", "model.gdn_implementation=xla"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) >= 1 and all(w in vocab for w in words)


def test_train_on_a_text_file(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"line {i} of some text"}) for i in range(50)))
    assert main(["train", "tiny", *SMALL, "data.source=text", f"data.path={data}", "model.vocab_size=256",
                 "train.steps=3", f"train.out_dir={tmp_path / 'run'}"]) == 0
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text("not json\n")
    err = _error(capsys, ["train", "tiny", "data.source=text", f"data.path={tmp_path / 'bad.jsonl'}",
                          f"train.out_dir={tmp_path / 'run2'}"])
    assert "line 1: expected a JSON object" in err


@pytest.mark.parametrize("family", ["qwen3_5", "olmo_hybrid"])
def test_train_and_generate_each_family(capsys, tmp_path, family):
    """A GDN + attention model of the family trains and generates from its run."""
    model = [f"model.family={family}", "model.layer_types=[linear_attention, full_attention]",
             "model.linear_num_value_heads=6", "model.linear_num_key_heads=2"]
    if family == "olmo_hybrid":
        model += ["model.linear_allow_neg_eigval=true", "model.partial_rotary_factor=1.0"]
    assert main(["train", "tiny", *SMALL, *model, "train.steps=3", f"train.out_dir={tmp_path}"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["model"]["family"] == family
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "1 17 2 18 1", "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
