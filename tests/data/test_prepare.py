"""`gdnx prepare`: shards, document index, validation split, raw bytes,
tokenizers, dtype by vocabulary size, reruns that do nothing, errors."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gdnx.cli import main
from gdnx.data.prepare import prepare_corpus
from gdnx.data.text import BYTES_EOS
from gdnx.data.tokens import TokenShards


def _corpus(tmp_path, n=200):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * (i % 5 + 1)})
                                                         for i in range(n)) + "\n\n")
    (tmp_path / "docs" / "b.txt").write_bytes(bytes(range(1, 256)) * 3)  # raw bytes, not UTF-8
    return tmp_path / "docs"


def _all_tokens(directory):
    return {s: (np.asarray(TokenShards(directory, s).tokens), TokenShards(directory, s).ends) for s in ("train", "val")}


def test_bytes_documents_split_and_rerun(tmp_path):
    meta = prepare_corpus([_corpus(tmp_path)], tmp_path / "out", val_fraction=0.1)
    splits = meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 201
    assert splits["val"]["documents"] == 20 and meta["dtype"] == "uint16"  # int(201 * 0.1), exactly
    shards = _all_tokens(tmp_path / "out")
    texts = []
    for tokens, ends in shards.values():
        starts = np.concatenate([[0], ends[:-1]])
        assert (tokens[ends - 1] == BYTES_EOS).all()  # every document ends with its EOS
        texts += [bytes(tokens[a:b - 1].astype(np.uint8)) for a, b in zip(starts, ends)]
    assert bytes(range(1, 256)) * 3 in texts  # the .txt file's raw bytes, unchanged
    assert "doc 3 doc 3 doc 3 doc 3 ".encode() in texts
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    again = prepare_corpus([tmp_path / "docs"], tmp_path / "out", val_fraction=0.1)
    assert again.get("up_to_date") and {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
    # the split is a function of the documents, not of the run or of where the files lie
    (tmp_path / "elsewhere").mkdir()
    moved = (tmp_path / "docs").rename(tmp_path / "elsewhere" / "corpus")
    prepare_corpus([moved], tmp_path / "out2", val_fraction=0.1)
    for s in ("train", "val"):
        np.testing.assert_array_equal(_all_tokens(tmp_path / "out2")[s][0], shards[s][0])


def test_a_tokenizer_and_a_large_vocabulary(tmp_path):
    corpus = _corpus(tmp_path, 50)
    for vocab, dtype in ((100, "uint16"), (70_000, "uint32")):
        words = {"[UNK]": 0, "</s>": 1, **{"doc": 2}, **{str(i): 3 + i for i in range(50)}}
        words.update({f"w{i}": len(words) + i for i in range(vocab - len(words))})
        tok = Tokenizer(WordLevel(vocab=words, unk_token="[UNK]"))
        tok.pre_tokenizer = Whitespace()
        tok.save(str(tmp_path / f"tok{vocab}.json"))
        meta = prepare_corpus([corpus / "a.jsonl"], tmp_path / f"out{vocab}",
                              tokenizer=str(tmp_path / f"tok{vocab}.json"))
        assert meta["dtype"] == dtype and meta["vocab_size"] == vocab
        tokens, ends = _all_tokens(tmp_path / f"out{vocab}")["train"]
        assert (tokens[ends - 1] == 1).all() and tokens[0] == 2  # "doc" then its number; </s> ends each


def test_prepare_command_and_its_errors(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "out")]) == 0
    assert "written; train" in capsys.readouterr().err
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "out")]) == 0
    assert "up to date" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": ["a"]}\n')
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert 'line 1: "text" is a list, expected a string' in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--val-fraction"):
        prepare_corpus([corpus], tmp_path / "o", val_fraction=1.0)


def test_a_tokenizer_without_a_known_end_token_needs_one_named(tmp_path):
    corpus = _corpus(tmp_path, 20)
    tok = Tokenizer(WordLevel(vocab={"[UNK]": 0, "doc": 1, "|end|": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match=r"name its end-of-document token \(gdnx prepare --eos-token, or "):
        prepare_corpus([corpus / "a.jsonl"], tmp_path / "out", tokenizer=str(tmp_path / "tok.json"))
    meta = prepare_corpus([corpus / "a.jsonl"], tmp_path / "out", tokenizer=str(tmp_path / "tok.json"),
                          eos_token="|end|")
    tokens, ends = _all_tokens(tmp_path / "out")["train"]
    assert meta["fingerprint"]["eos"] == 2 and (tokens[ends - 1] == 2).all()


def test_text_without_newlines_is_tokenized_a_block_at_a_time(tmp_path, monkeypatch):
    """A .txt file with no newline is not held whole until its end (a 20 MB
    one used to take gigabytes): it is cut at spaces, or at a character's
    boundary, a block at a time, and gives the tokens of the whole text."""
    import gdnx.data.prepare as module

    words = {"[UNK]": 0, "</s>": 1, **{f"w{i}": 2 + i for i in range(10)}}
    tok = Tokenizer(WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    text = " ".join(f"w{i % 10}" for i in range(5000)) + " " + "é" * 300  # one line; then no space either
    (tmp_path / "one.txt").write_text(text)
    block = 64
    monkeypatch.setattr(module, "_TEXT_BLOCK", block)
    sizes = []
    real = module.HFTokenizer.encode
    monkeypatch.setattr(module.HFTokenizer, "encode", lambda self, t: sizes.append(t) or real(self, t))
    prepare_corpus([tmp_path / "one.txt"], tmp_path / "out", tokenizer=str(tmp_path / "tok.json"), val_fraction=0.0)
    assert max(len(t.encode()) for t in sizes) <= 2 * block and len(sizes) > 100
    assert not any("\ufffd" in t for t in sizes)
    tokens = np.asarray(TokenShards(tmp_path / "out", "train").tokens)
    want = [words[w] for w in text.split()[:-1]]
    np.testing.assert_array_equal(tokens[:len(want)], want)
    # the é run, cut between characters (never inside one: no U+FFFD), is unknown words, then </s>
    assert set(tokens[len(want):-1].tolist()) == {0} and tokens[-1] == 1
