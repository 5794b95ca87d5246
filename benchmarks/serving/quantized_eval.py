"""`gdnx eval` of a small trained model, quantized and not: the difference in
points.

    python -m benchmarks.serving.quantized_eval [--docs 500] [--run DIR]

Model: `gdnx train`'s default, the tiny two-layer GDN model trained on
multi-query associative recall (configs/tiny.yml, about 3 minutes here;
--run reuses a finished run), exported as a Hugging Face directory with a
word-level tokenizer (token i is the word `t<i>`). Task: a local
multiple-choice task of --docs fresh MQAR rows, each cut after a key's
first query: the answer is its value, against three other values (chance
25%; only recall answers it). `gdnx eval`'s model (gdnx.evaluation.GdnxLM)
scores it unquantized and with --quantize int8, fp8 (blocks of 128 x 128:
here a whole matrix is one block), int4 (blocks of 1 x 32, a factor per
output row and 32 inputs), fp8 in blocks of 32 x 32, and the same with the
activations in float8 too (model.quantize_activations=fp8, one factor per
token and 32 inputs). Prints markdown for docs/benchmarks.md: accuracy,
its difference in points, and the mean absolute change of the answers'
log-likelihoods.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness import machine

KINDS = {"none": [], "int8": ["model.quantize=int8"], "fp8": ["model.quantize=fp8"],
         "int4 (1 x 32)": ["model.quantize=int4", "model.quantize_block=[1,32]"],
         "fp8 (32 x 32)": ["model.quantize=fp8", "model.quantize_block=[32,32]"],
         "fp8, fp8 activations (32 x 32)": ["model.quantize=fp8", "model.quantize_block=[32,32]",
                                            "model.quantize_activations=fp8"]}


def train(run: Path) -> None:
    subprocess.run([sys.executable, "-m", "gdnx.cli", "train", "tiny", f"train.out_dir={run}"], check=True)


def tokenizer(directory: Path, vocab: int) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0", "pad_token": "t0"}))


def task(directory: Path, docs: int, data: dict) -> None:
    """MQAR rows cut after a first query's key; choices: its value and three others."""
    import jax

    from gdnx.data.mqar import mqar_batch

    inputs, targets, _, first = (np.asarray(a) for a in mqar_batch(
        jax.random.key(12345), docs, data["seq_len"], data["num_pairs"], data["num_keys"], data["num_values"]))
    rng = np.random.default_rng(0)
    with open(directory / "recall.jsonl", "w") as f:
        for row in range(docs):
            pos = int(rng.choice(np.flatnonzero(first[row])))
            answer = int(targets[row, pos])
            others = rng.choice([v for v in range(data["num_keys"], data["num_keys"] + data["num_values"])
                                 if v != answer], 3, replace=False)
            choices = [answer, *(int(v) for v in others)]
            order = rng.permutation(4)
            f.write(json.dumps({"context": " ".join(f"t{t}" for t in inputs[row, :pos + 1]),
                                "choices": [f"t{choices[i]}" for i in order],
                                "answer": int(np.flatnonzero(order == 0)[0])}) + "\n")
    (directory / "recall.yaml").write_text(
        f"task: recall\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / 'recall.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\ntarget_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=500)
    p.add_argument("--run", type=Path, default=None, help="a finished `gdnx train tiny` run (default: train one)")
    args = p.parse_args()
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import lm_eval
    from lm_eval.tasks import TaskManager

    from gdnx.evaluation import GdnxLM
    from gdnx.export import export_run
    from gdnx.inference import load

    root = Path(tempfile.mkdtemp(prefix="gdnx-quantized-eval-"))
    run = args.run or root / "run"
    if args.run is None:
        train(run)
    config = json.loads((run / "config.json").read_text())
    export_run(run, root / "model")
    tokenizer(root / "model", config["model"]["vocab_size"])
    (root / "tasks").mkdir()
    task(root / "tasks", args.docs, config["data"])
    manager = TaskManager(include_path=str(root / "tasks"))
    results, answers = {}, {}
    for kind, overrides in KINDS.items():
        lm = GdnxLM(load(root / "model", overrides, "eval"), batch_size=32, progress=False)
        out = lm_eval.simple_evaluate(model=lm, tasks=["recall"], task_manager=manager, log_samples=True)
        results[kind] = out["results"]["recall"]["acc,none"]
        samples = sorted(out["samples"]["recall"], key=lambda s: s["doc_id"])
        answers[kind] = np.asarray([float(s["resps"][s["target"]][0][0]) for s in samples])
    print(f"{machine()}; `python -m benchmarks.serving.quantized_eval --docs {args.docs}`; "
          f"the tiny MQAR model (configs/tiny.yml), {args.docs} first-query recalls, 4 choices\n")
    print("| weights | accuracy | vs unquantized (points) | mean abs. change of the answer's log-likelihood |")
    print("|---|---:|---:|---:|")
    for kind in KINDS:
        print(f"| {kind} | {100 * results[kind]:.1f}% | {100 * (results[kind] - results['none']):+.1f} | "
              f"{np.mean(np.abs(answers[kind] - answers['none'])):.4f} |")


if __name__ == "__main__":
    main()
