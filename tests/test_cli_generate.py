"""`gdnx generate --prompts-file`: a jsonl of prompts through the engine,
results in order; each mistake one line and status 2."""

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
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_5", scale=5.0, tokenizer="words", gdn_chunk_size=16)
    return hf_checkpoints.path("qwen3_5", scale=5.0, tokenizer="words"), model


def test_prompts_file_results_in_order(checkpoint, tmp_path, capsys):
    path, model = checkpoint
    rng = np.random.default_rng(0)
    shared = rng.integers(1, VOCAB, 70).tolist()      # more than one block (4 chunks of 16)
    prompts = [shared + [3], rng.integers(1, VOCAB, 5).tolist(), shared + [9, 4], rng.integers(1, VOCAB, 12).tolist()]
    lines = [{"prompt": words(prompts[0])}, {"prompt": words(prompts[1]), "max_tokens": 3},
             {"prompt": words(prompts[2]), "logprobs": 2},
             {"prompt": words(prompts[3]), "temperature": 0.9, "top_k": 5, "seed": 7, "stop": ["w1"]}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out" / "results.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(src), "--out", str(out),
                 "--max-new-tokens", "6", "--max-slots", "2", "--prefix-cache-mb", "16", "--speculative", "2",
                 "model.gdn_chunk_size=16"]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["prompt"] for g in got] == [x["prompt"] for x in lines]
    for i in (0, 2):  # greedy lines: the plain path's tokens
        plain = np.asarray(generate(model, jnp.asarray([prompts[i]]), 6))[0].tolist()
        assert got[i]["tokens"] == plain and got[i]["completion"] == words(plain)
    assert len(got[1]["tokens"]) == 3 and got[1]["finish_reason"] == "length"
    assert got[2]["cached_tokens"] == 64 and len(got[2]["logprobs"]) == 6
    assert all(len(x["top"]) == 2 for x in got[2]["logprobs"])
    assert "w1" not in got[3]["completion"].split()
    err = capsys.readouterr().err
    assert "wrote 4 results" in err and "4/4" in err


def test_the_checkpoints_mtp_module_drafts_and_keeps_the_plain_tokens(checkpoint, tmp_path, capsys):
    """--speculative mtp on a Qwen3.5 checkpoint with an MTP module (mtp.*):
    the plain path's greedy tokens, its drafts verified."""
    from tests.helpers.mtp import mtp_checkpoint

    src, model = checkpoint
    path, _, _ = mtp_checkpoint(src, tmp_path / "mtp", np.random.default_rng(0))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 20)]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("\n".join(json.dumps({"prompt": words(p)}) for p in prompts) + "\n")
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(lines), "--out", str(out),
                 "--max-new-tokens", "6", "--max-slots", "2", "--draft-rows", "2", "--speculative", "mtp",
                 "model.gdn_chunk_size=16"]) == 0
    got = [json.loads(x)["tokens"] for x in out.read_text().splitlines()]
    assert got == [np.asarray(generate(model, jnp.asarray([p]), 6))[0].tolist() for p in prompts]
    err = capsys.readouterr().err
    assert re.search(r"speculative: \d+ of [1-9]\d* drafted tokens accepted \(\d+%\)", err), err
    # both slots decoding past --draft-rows 1: drafting is off, and the summary says so rather than "0%"
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(lines), "--out", str(tmp_path / "o1"),
                 "--max-new-tokens", "6", "--max-slots", "2", "--draft-rows", "1", "--speculative", "mtp",
                 "model.gdn_chunk_size=16"]) == 0
    assert "speculative: no draft proposed (drafts are verified while at most --draft-rows=1" in \
        capsys.readouterr().err


@pytest.mark.parametrize("value", ["mtp:x", "eagle", "ngram", "mtp:0"])
def test_a_bad_speculative_value_is_one_line(checkpoint, tmp_path, capsys, value):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "w1"}\n')
    err = refused(capsys, ["generate", "--checkpoint", str(checkpoint[0]), "--prompts-file", str(src), "--out",
                           str(tmp_path / "o.jsonl"), "--speculative", value])
    assert "--speculative: " in err, err


@pytest.mark.parametrize("flags", [["--speculative", "mtp"], ["--speculative", "eagle"], ["--speculative", "3"],
                                   ["--draft-rows", "2"], ["--max-slots", "4"], ["--batch-invariant"]])
def test_an_engine_flag_with_prompt_is_one_line_before_the_model_loads(tmp_path, capsys, flags):
    """--prompt decodes with the plain loop: the batched engine's settings
    (drafting above all) are refused there, not ignored."""
    err = refused(capsys, ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "w1", *flags])
    assert err.startswith(f"gdnx generate: error: {flags[0]}: applies to --prompts-file"), err


@pytest.mark.parametrize("line,match", [
    ("not json", "line 1: not JSON"),
    ('{"text": "w1"}', 'line 1: expected an object with a "prompt" string'),
    ('{"prompt": "w1", "temp": 1}', "line 1: unknown field 'temp'"),
    ('{"prompt": "w1", "temperature": -1}', "line 1: temperature: expected a number in"),
    ('{"prompt": "w1 w2 w3 w4 w5 w6", "max_tokens": 8}', "line 1: max_tokens: the prompt's 6 tokens"),
    ('{"prompt": ""}', "line 1: prompt: expected at least one token"),
])
def test_each_prompts_file_mistake_is_one_line(checkpoint, tmp_path, capsys, line, match):
    src = tmp_path / "p.jsonl"
    src.write_text(line + "\n")
    err = refused(capsys, ["generate", "--checkpoint", str(checkpoint[0]), "--prompts-file", str(src), "--out",
                          str(tmp_path / "o.jsonl"), "--max-length", "10"])
    assert match in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_line_past_the_models_positions_is_named_not_a_flag_never_given(checkpoint, tmp_path, capsys):
    """Without --max-length the engine is sized by the longest line: a line
    past the model's positions is refused naming the line, not --max-length."""
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "w1"}\n{"prompt": "w1 w2", "max_tokens": 10000000}\n')
    err = refused(capsys, ["generate", "--checkpoint", str(checkpoint[0]), "--prompts-file", str(src), "--out",
                          str(tmp_path / "o.jsonl")])
    assert "--prompts-file: line 2: 2 prompt tokens + max_tokens 10000000 = 10000002 exceed the model's" in err, err
    assert "--max-length" not in err, err


def test_out_goes_with_prompts_file(checkpoint, tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "w1"}\n')
    base = ["generate", "--checkpoint", str(checkpoint[0])]
    assert "--out: --prompts-file writes" in refused(capsys, base + ["--prompts-file", str(src)])
    assert "--out: applies to --prompts-file" in refused(capsys, base + ["--prompt", "w1", "--out", "x"])
    assert "--prompts-file: no such file" in refused(capsys, base + ["--prompts-file", "nope", "--out", "x"])
    assert "--max-slots: expected an integer >= 1" in refused(capsys, base + ["--prompts-file", str(src), "--out",
                                                                             str(tmp_path / "o"), "--max-slots", "0"])
    # an engine field's refusal names the flag typed (the engine's field is prefix_cache_bytes)
    assert "--prefix-cache-mb: expected a non-negative integer" in refused(
        capsys, base + ["--prompts-file", str(src), "--out", str(tmp_path / "o"), "--prefix-cache-mb", "-1"])


@pytest.mark.parametrize("out,match", [
    ("dir", "is a directory"), ("prompts", "is the prompts file"), ("file/x.jsonl", "is not a directory")])
def test_out_is_checked_before_the_model_loads(tmp_path, capsys, out, match):
    src = tmp_path / "prompts"
    src.write_text('{"prompt": "w1"}\n')
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    # the checkpoint does not exist: --out is refused first
    err = refused(capsys, ["generate", "--checkpoint", str(tmp_path / "none"), "--prompts-file", str(src),
                          "--out", str(tmp_path / out)])
    assert err.startswith("gdnx generate: error: --out:") and match in err, err


@pytest.mark.parametrize("content,flags,match", [
    (b'{"prompt": "w1"}\n{"prompt": "\xff"}\n', [], "--prompts-file: line 2: not UTF-8 text"),
    (b'{"prompt": "w1"}\n', ["--seed", str(2 ** 64)], "--seed: expected an integer in [0, 2**63)"),
    (b'{"prompt": "w1"}\n', ["--resume"], "--resume: applies to --prompts-file"),
])
def test_more_prompts_file_mistakes_are_one_line(tmp_path, capsys, content, flags, match):
    src = tmp_path / "p.jsonl"
    src.write_bytes(content)
    what = ["--prompt", "w1"] if "--resume" in flags else ["--prompts-file", str(src), "--out", str(tmp_path / "o")]
    err = refused(capsys, ["generate", "--checkpoint", str(tmp_path), *what, *flags])
    assert match in err, err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_prompts_file_keeps_its_results_and_resume_finishes_it(checkpoint, tmp_path, capsys,
                                                                         monkeypatch, how):
    """Results are written in order as they finish; Ctrl-C (status 130) or
    SIGTERM (status 75) leaves those in --out and says how many; --resume
    runs the rest: the file then equals an uninterrupted run's."""
    import signal

    from gdnx.serving import Engine

    path, _ = checkpoint
    rng = np.random.default_rng(3)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": words(rng.integers(1, VOCAB, n).tolist()),
                                       "max_tokens": int(m)}) + "\n"
                           for n, m in zip((5, 9, 3, 12, 7, 4), (2, 9, 3, 9, 2, 5))))
    argv = ["generate", "--checkpoint", str(path), "--prompts-file", str(src), "--max-slots", "2",
            "model.gdn_chunk_size=16", "--out"]
    assert main([*argv, str(tmp_path / "straight.jsonl")]) == 0
    want = (tmp_path / "straight.jsonl").read_text().splitlines(keepends=True)
    real, calls = Engine.step, []

    def interrupted(self, decode=True):
        calls.append(1)
        if len(calls) == 2:
            if how == "ctrl-c":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGTERM)
        return real(self, decode)

    monkeypatch.setattr(Engine, "step", interrupted)
    out = tmp_path / "out.jsonl"
    if how == "ctrl-c":
        assert main([*argv, str(out)]) == 130
    else:
        with pytest.raises(SystemExit) as stopped:
            main([*argv, str(out)])
        assert stopped.value.code == 75
    got = out.read_text().splitlines(keepends=True)
    assert 0 < len(got) < 6 and got == want[:len(got)]
    assert f"{len(got)} of 6 results in {out}; run the same command with --resume" in capsys.readouterr().err
    monkeypatch.setattr(Engine, "step", real)
    with out.open("a") as f:
        f.write('{"prompt": "cut sho')  # a line a kill cut short is run again
    assert main([*argv, str(out), "--resume"]) == 0
    assert out.read_text().splitlines(keepends=True) == want


def test_prompts_file_lines_take_an_output_constraint(tmp_path, capsys):
    """response_format and structured_outputs per line, as the server reads
    them, on a checkpoint with a byte-level BPE vocabulary; a bad one is one
    line naming the line and the field."""
    import re

    import jsonschema

    from tests.helpers.hf_models import BPE_VOCAB, random_hf_model, write_bpe_tokenizer
    from tests.helpers.serving import SCHEMA

    path = tmp_path / "bpe"
    random_hf_model("qwen3_5", vocab_size=BPE_VOCAB, eos_token_id=0).save_pretrained(path)
    write_bpe_tokenizer(path)
    lines = [{"prompt": "a", "temperature": 1.0, "max_tokens": 80,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
             {"prompt": "b", "temperature": 1.0, "structured_outputs": {"regex": "[0-9]{3}"}}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    flags = ["--prompts-file", str(src), "--out", str(out), "--max-new-tokens", "8", "model.gdn_chunk_size=16"]
    assert main(["generate", "--checkpoint", str(path), *flags]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    jsonschema.validate(json.loads(got[0]["completion"]), SCHEMA)
    assert re.fullmatch("[0-9]{3}", got[1]["completion"])
    capsys.readouterr()
    src.write_text(json.dumps({"prompt": "a", "structured_outputs": {"regex": "("}}) + "\n")
    err = refused(capsys, ["generate", "--checkpoint", str(path), *flags])
    assert "line 1: structured_outputs.regex: not a valid regex" in err, err


@pytest.mark.slow
def test_a_failed_request_is_an_error_record_in_its_place_and_resume_runs_it_again(checkpoint, tmp_path, capsys,
                                                                                  monkeypatch):
    """A request that fails on the engine (here: its line's seed fails it in
    _emit, where the engine fails a request whose constraint, detokenizer or
    drafter raised) is written as an error record with its line number, the
    later lines' results follow it, the summary counts it and the status is
    1; --resume runs it (and what follows) again, and the file then equals
    an uninterrupted run's."""
    from gdnx.serving import Engine

    path, _ = checkpoint
    rng = np.random.default_rng(4)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": words(rng.integers(1, VOCAB, n).tolist()), "seed": seed}) + "\n"
                           for n, seed in zip((5, 9, 3, 7), (1, 99, 2, 3))))
    argv = ["generate", "--checkpoint", str(path), "--prompts-file", str(src), "--max-slots", "2",
            "--max-new-tokens", "4", "model.gdn_chunk_size=16", "--out"]
    assert main([*argv, str(tmp_path / "straight.jsonl")]) == 0
    want = (tmp_path / "straight.jsonl").read_text().splitlines(keepends=True)
    capsys.readouterr()
    real = Engine._emit

    def failing(self, req, new, lp, row, logits, results):
        if req.params.seed == 99:
            return self._fail(req, "injected failure", results)
        return real(self, req, new, lp, row, logits, results)

    monkeypatch.setattr(Engine, "_emit", failing)
    out = tmp_path / "out.jsonl"
    assert main([*argv, str(out)]) == 1
    got = out.read_text().splitlines(keepends=True)
    assert len(got) == 4 and [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert {k: v for k, v in json.loads(got[1]).items() if k != "prompt"} == {"line": 2, "error": "injected failure"}
    err = capsys.readouterr().err
    assert "wrote 4 results" in err and "1 of them failed (line 2: error records in" in err, err
    monkeypatch.setattr(Engine, "_emit", real)
    assert main([*argv, str(out), "--resume"]) == 0
    assert out.read_text().splitlines(keepends=True) == want


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_through_the_engine_gives_the_plain_paths_tokens(checkpoint, hf_checkpoints, tmp_path, kind):
    """--quantize: the engine (prefix cache, speculation, batching) on the
    quantized model gives gdnx.generate's greedy tokens for that model."""
    from gdnx.models import CausalLM

    path, _ = checkpoint
    model = CausalLM.from_pretrained(path, quantize=kind, gdn_chunk_size=16)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (20, 7, 33)]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": words(p)}) + "\n" for p in prompts))
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(src), "--out", str(out),
                 "--max-new-tokens", "6", "--max-slots", "2", "--prefix-cache-mb", "16", "--speculative", "2",
                 "--quantize", kind, "model.gdn_chunk_size=16"]) == 0
    got = [json.loads(x)["tokens"] for x in out.read_text().splitlines()]
    assert got == [np.asarray(generate(model, jnp.asarray([p]), 6))[0].tolist() for p in prompts]
