"""The `gdnx` command: every user error is one line on stderr and exit
status 2, nothing written before is touched; generate from a gdnx run and
from a Hugging Face directory."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gdnx.cli import main
from tests.helpers.hf_models import VOCAB
from tests.helpers.configs import SMALL_RUN
from tests.helpers.cli import refused
from tests.helpers.tiers import fast_only


@pytest.mark.parametrize("argv,expected", [
    (["train", "model.hidden_sise=8"], "gdnx train: error: model.hidden_sise: unknown key"),
    (["train", "tiny", "train.steps=-3"], "gdnx train: error: train.steps: Input should be greater than 0"),
    (["train", "tiny", "model.gdn_chunk_size=48"], "gdnx train: error: model.gdn_chunk_size: expected one of"),
    (["train", "missing.yml"], "gdnx train: error: config 'missing.yml': no such file"),
    (["train", "tiny", "data.source=text", "data.path=/no/such.txt"],
     "gdnx train: error: data.path: /no/such.txt: no such file or directory"),
    (["train", "tiny", "model.gdn_interpret=false"], "gdnx train: error: model.gdn_interpret: false compiles"),
    (["generate", "--checkpoint", "/no/such/dir", "--prompt", "1 2"], "gdnx generate: error: --checkpoint: no such"),
    (["generate", "--checkpoint", ".", "--prompt", "1", "--temperature", "-1"],
     "gdnx generate: error: --temperature: expected >= 0"),
    (["bench", "--seq-len", "0"], "gdnx bench: error: --seq-len: expected a positive integer"),
    (["train", "tiny", "parallel.tensor=2"], "gdnx train: error: parallel: the fixed axis sizes multiply to 2"),
    (["train", "tiny", "parallel.context=0"], "gdnx train: error: parallel.context: expected a positive axis size"),
    (["train", "tiny", "model.quantize=int8"], "gdnx train: error: model.quantize: int8 weights are frozen"),
    (["plan", "tiny", "--topology", "v7:2x2"],
     "gdnx plan: error: --topology: expected a TPU slice <generation>:<shape>"),
    (["plan", "tiny", "--topology", "v5p:2x2x1", "train.grad_accum_steps=3"],
     "gdnx plan: error: train.grad_accum_steps: must divide batch_size=16"),
    # a train step over frozen weights, refused by plan as by train
    (["plan", "tiny", "--topology", "v5e:2x2", "--quantize", "int8"],
     "gdnx plan: error: model.quantize: int8 weights are frozen"),
    # a size the engine allocates by, refused before anything is allocated, naming its flag
    (["plan", "tiny", "--topology", "v5e:2x2", "--serve", "--max-slots", "1000000000"],
     "gdnx plan: error: --max-slots: expected at most 65,536 requests decoded together"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert refused(capsys, argv).startswith(expected)
    assert not (tmp_path / "runs").exists()  # nothing written for a refused run


@pytest.mark.slow
def test_checkpoint_of_another_config_is_refused_and_left_alone(capsys, tmp_path):
    out = f"train.out_dir={tmp_path}"
    assert main(["train", "tiny", *SMALL_RUN, "train.steps=3", "train.checkpoint_every=3", out]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, "model.hidden_size=48", "train.steps=3", out])
    assert "holds checkpoints of another config" in err and "model.hidden_size: 32 there, 48 here" in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    # generate from that run: MQAR prompts are token ids
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "1 17 2 18 1", "--max-new-tokens", "3"]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 3 and all(0 <= int(t) < 32 for t in printed)
    err = refused(capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", "hello"])
    assert "--prompt: this model was trained on MQAR" in err
    # the same prompt through the engine, beside another: the same greedy tokens
    src, res = tmp_path / "gen" / "prompts.jsonl", tmp_path / "gen" / "results.jsonl"
    src.parent.mkdir()
    src.write_text('{"prompt": "1 17 2 18 1"}\n{"prompt": "3 4", "max_tokens": 2}\n')
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompts-file", str(src), "--out", str(res),
                 "--max-new-tokens", "3"]) == 0
    got = [json.loads(line) for line in res.read_text().splitlines()]
    assert got[0]["tokens"] == [int(t) for t in printed] and len(got[1]["tokens"]) == 2


@pytest.mark.parametrize("kind", fast_only(["qwen3_next", "qwen3_5_moe", "olmo_hybrid"], lambda k: k == "qwen3_next"))
def test_generate_from_a_hugging_face_directory(capsys, hf_checkpoints, kind):
    vocab = {f"w{i}": i for i in range(VOCAB)}
    path = hf_checkpoints.path(kind, tokenizer="words")
    assert main(["generate", "--checkpoint", str(path), "--prompt", "w1 w5 w9", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--top-p", "0.9", "model.gdn_implementation=xla"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) >= 1 and all(w in vocab for w in words)


@pytest.mark.slow
def test_a_hugging_face_directory_decodes_alike_with_its_layers_scanned_or_unrolled(capsys, hf_checkpoints):
    """model.scan_layers: the same greedy words either way (a layout for serving: on CPU an unrolled decode step
    runs about twice as fast, docs/benchmarks.md; a deep stack compiles longer)."""
    path = hf_checkpoints.path("qwen3_next", tokenizer="words")
    out = []
    for scan in ("true", "false"):
        assert main(["generate", "--checkpoint", str(path), "--prompt", "w1 w5 w9", "--max-new-tokens", "6",
                     "--temperature", "0", f"model.scan_layers={scan}"]) == 0
        out.append(capsys.readouterr().out)
    assert out[0] == out[1] and out[0].split()


def test_train_on_a_text_file(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"line {i} of some text"}) for i in range(50)))
    assert main(["train", "tiny", *SMALL_RUN, "data.source=text", f"data.path={data}", "model.vocab_size=256",
                 "train.steps=3", f"train.out_dir={tmp_path / 'run'}"]) == 0
    assert "perplexity" in capsys.readouterr().err  # the evaluation line of a text run
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "line 3", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    err = refused(capsys, ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x", "model.scan_layers=false"])
    assert err.startswith("gdnx generate: error: model.scan_layers: a gdnx run's checkpoint restores in"), err
    # the text changed under a run with checkpoints: refused, not re-tokenized and resumed on other data
    data.write_text(data.read_text() + "\n" + json.dumps({"text": "one more line"}))
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, "data.source=text", f"data.path={data}", "model.vocab_size=256",
                          "train.steps=4", f"train.out_dir={tmp_path / 'run'}"])
    assert "data.path: " in err and "changed since" in err and "restore it, or use another train.out_dir" in err
    # shards from gdnx prepare: generate finds their tokenizer
    assert main(["prepare", str(data), "--out", str(tmp_path / "shards")]) == 0
    assert main(["train", "tiny", *SMALL_RUN, "data.source=tokens", f"data.path={tmp_path / 'shards'}",
                 "model.vocab_size=256", "train.steps=3", f"train.out_dir={tmp_path / 'run3'}"]) == 0
    assert main(["generate", "--checkpoint", str(tmp_path / "run3"), "--prompt", "line", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    (tmp_path / "bad.jsonl").write_text("not json\n")
    err = refused(capsys, ["train", "tiny", "data.source=text", f"data.path={tmp_path / 'bad.jsonl'}",
                          f"train.out_dir={tmp_path / 'run2'}"])
    assert "line 1: expected a JSON object" in err


@pytest.mark.parametrize("family", fast_only(["qwen3_5", "olmo_hybrid"], lambda f: f == "qwen3_5"))
def test_train_and_generate_each_family(capsys, tmp_path, family):
    """A GDN + attention model of the family trains and generates from its run."""
    model = [f"model.family={family}", "model.layer_types=[linear_attention, full_attention]",
             "model.linear_num_value_heads=6", "model.linear_num_key_heads=2"]
    if family == "olmo_hybrid":
        model += ["model.linear_allow_neg_eigval=true", "model.partial_rotary_factor=1.0"]
    assert main(["train", "tiny", *SMALL_RUN, *model, "train.steps=3", f"train.out_dir={tmp_path}"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["model"]["family"] == family
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "1 17 2 18 1", "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    # exported, transformers computes the run's logits (1e-4 relative, the parity tests' tolerance)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == 0
    assert "no tokenizer.json: none copied" in capsys.readouterr().err  # MQAR has token ids only
    import torch
    import transformers

    from gdnx.measure import relative_error
    from gdnx.runs import load_run

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    toks = np.random.default_rng(0).integers(0, 32, (2, 24))
    with torch.no_grad():
        theirs = hf(torch.tensor(toks)).logits.numpy()
    ours = load_run(tmp_path).model(jnp.asarray(toks, jnp.int32))
    assert relative_error(ours, theirs) <= 1e-4
    assert "--out " in refused(capsys, ["export", str(tmp_path), "--out", str(tmp_path / "hf")])  # not empty


def _tokenizer(path):
    tok = Tokenizer(WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def test_every_data_and_file_mistake_is_one_line(capsys, tmp_path, monkeypatch):
    """Data files, tokenizers, out_dir: one line naming the key or path, exit 2."""
    monkeypatch.chdir(tmp_path)
    text = ["train", "tiny", *SMALL_RUN, "data.source=text", "model.vocab_size=256"]
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    assert 'line 1: "text" is a int, expected a string' in refused(capsys, [*text, "data.path=num.jsonl"])
    (tmp_path / "bin.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n')
    assert "bin.jsonl line 1: not UTF-8 text (byte 10)" in refused(capsys, [*text, "data.path=bin.jsonl"])
    (tmp_path / "ok.txt").write_text("some text " * 20)
    (tmp_path / "tokenizer.json").write_text("{not json")
    err = refused(capsys, [*text, "data.path=ok.txt", "data.tokenizer=tokenizer.json"])
    assert "data.tokenizer: " in err and "is not a readable tokenizer.json" in err
    (tmp_path / "afile").write_text("x")
    assert "train.out_dir" in refused(capsys, ["train", "tiny", *SMALL_RUN, "train.out_dir=afile"])
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, f"train.out_dir={tmp_path / 'new'}"])
    assert f"{tmp_path} is not writable" in err


@pytest.mark.slow
def test_a_run_that_failed_before_its_first_checkpoint_does_not_bind_the_out_dir(capsys, tmp_path, monkeypatch):
    """Out of memory at the first step leaves config.json and no checkpoint:
    rerunning there with the error's advice (another shape) trains."""
    from gdnx.training import loop

    def exhausted(*a, **k):
        raise MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0TiB")
    out = f"train.out_dir={tmp_path}"
    with monkeypatch.context() as m:
        m.setattr(loop.Trainer, "step", exhausted)
        assert "out of memory" in refused(capsys, ["train", "tiny", *SMALL_RUN, "train.steps=3", out])
    assert (tmp_path / "config.json").is_file()
    assert main(["train", "tiny", *SMALL_RUN, "data.seq_len=36", "train.steps=3", out]) == 0


def test_every_config_and_size_mistake_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "train.learning_rate: Input should be a finite number" in refused(
        capsys, ["train", "tiny", "train.learning_rate=.inf"])
    assert "train.steps: expected a number, got true" in refused(capsys, ["train", "tiny", "train.steps=true"])
    # the base config holds the full-size defaults: refused before anything is built
    err = refused(capsys, ["train", "base"])
    assert "79.7B parameters need about" in err and "is a base for a run on a slice" in err
    assert not (tmp_path / "runs").exists()
    # a very deep stack is counted, not built: refused at once (building 100000 layers took hours)
    start = time.monotonic()
    err = refused(capsys, ["train", "base", "model.num_hidden_layers=100000", "model.layer_types=null"])
    assert "164692.4B parameters need about" in err and time.monotonic() - start < 30


@pytest.mark.slow
def test_resume_refuses_a_change_that_alters_results_and_records_the_others(capsys, tmp_path):
    out = f"train.out_dir={tmp_path}"
    assert main(["train", "tiny", *SMALL_RUN, "train.steps=3", "train.checkpoint_every=3", out]) == 0
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, "train.batch_size=8", "train.steps=4", out])
    assert "train.batch_size: 4 there, 8 here" in err
    saved = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text("{corrupt")
    assert "config.json: not valid JSON" in refused(capsys, ["train", "tiny", *SMALL_RUN, "train.steps=4", out])
    # no config.json beside the checkpoints: refused in one line, and nothing overwritten
    (tmp_path / "config.json").unlink()
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, "model.hidden_size=48", "train.steps=4", out])
    assert "holds checkpoints but no config.json" in err and not (tmp_path / "config.json").exists()
    (tmp_path / "config.json").write_text(saved)
    capsys.readouterr()
    assert main(["train", "tiny", *SMALL_RUN, "train.steps=4", "train.log_every=1", out]) == 0
    said = " ".join(capsys.readouterr().err.split())  # (the console wraps long notes)
    assert "train.steps: 3 there, 4 here: the learning rate's cosine decay now ends at step 4" in said
    change = json.loads((tmp_path / "config_changes.jsonl").read_text().splitlines()[-1])
    assert change["step"] == 3 and change["changed"]["train.steps"] == [3, 4]
    assert change["changed"]["train.log_every"] == [2, 1]
    mode = (tmp_path / "config.json").stat().st_mode & 0o777
    assert mode & 0o044 == 0o044, oct(mode)  # readable by the group and others (as the umask allows)


def test_every_generate_mistake_is_one_line(capsys, tmp_path, hf_checkpoints):
    run = tmp_path / "run"
    assert main(["train", "tiny", *SMALL_RUN, "train.steps=3", "train.checkpoint_every=3", f"train.out_dir={run}"]) == 0
    capsys.readouterr()
    gen = ["generate", "--checkpoint", str(run), "--prompt", "1 2 3"]
    err = refused(capsys, [*gen, "--max-new-tokens", str(10 ** 12)])
    assert "--max-new-tokens: the prompt's 3 tokens + 1000000000000 exceed the model's 262144 positions" in err
    import gdnx.training.loop as loop

    with pytest.MonkeyPatch.context() as patch:  # a device too small: generate's own advice, not training's
        patch.setattr(loop, "memory_capacity", lambda devices: 1000)
        err = refused(capsys, [*gen, "--max-new-tokens", "8"])
    assert "--max-new-tokens: 11 tokens need" in err and "the prompt's pass" in err and "--max-new-tokens" in err
    assert "shorten the prompt" in err and "train.grad_accum_steps" not in err
    assert "model.hidden_size: generate takes overrides of the model.gdn_* fields" in refused(
        capsys, [*gen, "model.hidden_size=48"])
    (run / "config.json").write_text("{corrupt")
    assert "config.json is not a gdnx run config" in refused(capsys, gen)

    hf = tmp_path / "hf"
    shutil.copytree(hf_checkpoints.path("qwen3_next"), hf)  # damaged below
    _tokenizer(hf / "tokenizer.json")
    capsys.readouterr()
    err = refused(capsys, ["generate", "--checkpoint", str(hf), "--prompt", "w1 \ud800"])
    assert err.startswith("gdnx generate: error: --prompt: cannot be encoded")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "not a readable safetensors file" in refused(capsys, ["generate", "--checkpoint", str(hf), "--prompt", "w1"])
    (hf / "config.json").write_text("{corrupt")
    assert "config.json: not valid JSON" in refused(capsys, ["generate", "--checkpoint", str(hf), "--prompt", "w1"])


def test_distributed_on_a_plain_host_and_out_of_memory_are_one_line(capsys, tmp_path, monkeypatch):
    from gdnx.training import loop as train_module

    # several processes run under a supervisor process (gdnx.distributed): the line comes from the child
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS",
                                                                     "SLURM_", "OMPI_"))}
    done = subprocess.run([sys.executable, "-m", "gdnx", "train", "--distributed"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--distributed: the distributed runtime did not start" in done.stderr
    # a bad option is refused before any process starts
    assert "--process-id: expected 0 <= id < --num-processes (2), got 5" in refused(
        capsys, ["train", "--num-processes", "2", "--process-id", "5"])

    def exhausted(*a, **k):
        raise MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0TiB")
    monkeypatch.setattr(train_module.Trainer, "step", exhausted)
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, f"train.out_dir={tmp_path}"])
    assert "out of memory" in err and "train.grad_accum_steps" in err and "model.remat_policy=full" in err


def test_plan_without_libtpu_says_what_to_install(capsys):
    """This environment has no libtpu (the deviceless tests run where it is:
    tests/test_train_plan.py)."""
    pytest.importorskip("jax")
    try:
        import libtpu  # noqa: F401
        pytest.skip("libtpu is installed here")
    except ImportError:
        pass
    err = refused(capsys, ["plan", "tiny", "--topology", "v5p:2x2x1"])
    assert "libtpu cannot describe it" in err and "pip install 'jax[tpu]==" in err


def test_version_and_help_on_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("gdnx ")
    from gdnx.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help, f"gdnx {name} {action.option_strings or action.dest}: no help"


@pytest.mark.slow
def test_every_fine_tuning_mistake_is_one_line(capsys, tmp_path, hf_checkpoints):
    """A checkpoint of another model type, an architecture override, LoRA
    without a base, SFT examples the data or template refuse, an export of
    the wrong form: one line naming the field or line, exit 2; over-long
    examples are counted in the log."""
    hf = hf_checkpoints.path("qwen3_5", tokenizer="chat")
    ok = [{"prompt": "w10 w11", "completion": " w12"}] * 20
    (tmp_path / "ok.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ok))
    ft = ["train", "finetune", f"model.init_from={hf}", "data.seq_len=16", "train.batch_size=2", "train.steps=2",
          "train.warmup_steps=1", "train.eval_every=0", f"train.out_dir={tmp_path / 'run'}"]
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    err = refused(capsys, [*ft, f"model.init_from={llama}", f"data.path={tmp_path / 'ok.jsonl'}"])
    assert "model.init_from" in err and "model_type 'llama' is not a GDN hybrid gdnx builds" in err
    err = refused(capsys, [*ft, "model.hidden_size=64", f"data.path={tmp_path / 'ok.jsonl'}"])
    assert "model.hidden_size: 64 in the config, 32 in the checkpoint" in err
    err = refused(capsys, ["train", "tiny", "train.lora.rank=4"])
    assert "train.lora: adapters train on a frozen base; set model.init_from" in err
    bad = {"fields.jsonl": ({"question": "w1"}, 'line 1: expected {"messages": [...]}'),
           "role.jsonl": ({"messages": [{"role": "tool", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
                          "line 1: the chat template refused the messages: unknown role tool")}
    for name, (example, message) in bad.items():
        (tmp_path / name).write_text(json.dumps(example) + "\n")
        err = refused(capsys, [*ft, f"data.path={tmp_path / name}", f"train.out_dir={tmp_path / name}.run"])
        assert err.startswith("gdnx train: error: data.path: ") and message in err, err
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((hf / f).read_bytes())
    (bare / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes())
    (tmp_path / "chat.jsonl").write_text(json.dumps(bad["role.jsonl"][0]).replace("tool", "user") + "\n")
    err = refused(capsys, [*ft, f"model.init_from={bare}", f"data.path={tmp_path / 'chat.jsonl'}",
                          f"train.out_dir={tmp_path / 'bare.run'}"])
    assert "no chat template" in err
    long = [{"prompt": " ".join(["w9"] * 30), "completion": " w8"}] + ok
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(e) + "\n" for e in long))
    assert main([*ft, f"data.path={tmp_path / 'long.jsonl'}", "data.val_fraction=0"]) == 0
    assert "1 of the 21 training examples are longer than data.seq_len + 1 = 17 tokens: dropped" in \
        " ".join(capsys.readouterr().err.split())  # as one line, however the console wrapped it
    err = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--adapter"])
    assert "--adapter: the run trained every weight (no train.lora)" in err


def test_what_a_run_cannot_hold_or_write_is_refused_before_training(tmp_path, capsys):
    """A batch larger than the machine (before JAX allocates it), and a
    `checkpoints` that is a file in the out_dir (before the first step)."""
    err = refused(capsys, ["train", "tiny", "train.batch_size=1000000000", f"train.out_dir={tmp_path / 'big'}"])
    assert "train.batch_size: 1000000000 rows of" in err and "lower train.batch_size" in err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a directory")
    err = refused(capsys, ["train", "tiny", *SMALL_RUN, "train.steps=4", f"train.out_dir={tmp_path / 'run'}"])
    assert "checkpoints there is a file" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_plot_of_a_degenerate_run_prints_no_warning(tmp_path, capsys):
    from gdnx.progress import write_plot

    (tmp_path / "m.jsonl").write_text('{"step": 1, "split": "train", "loss": 0.0, "accuracy": 1.0}\n')
    write_plot(tmp_path / "m.jsonl", tmp_path / "m.png")
    assert (tmp_path / "m.png").is_file() and capsys.readouterr().err == ""
