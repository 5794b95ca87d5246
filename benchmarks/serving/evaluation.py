"""Evaluation throughput on this machine's CPU: loglikelihood requests per
second of `gdnx eval`'s model class against lm-eval's own `hf` backend
(transformers, torch), on the same checkpoint, task and cores, in one run.

    python -m benchmarks.serving.evaluation [--docs 64] [--batch-size 16]

Model: Qwen3.5's pattern (3 GDN layers, then attention), width 256, 8
layers, a 4,096-word vocabulary, float32, random weights, written by
transformers. Task: a local multiple-choice task of --docs questions of
50-300 words with 4 answers of 1-5 words (4 loglikelihood requests each).
Each backend runs the task once untimed (gdnx compiles its length buckets,
torch warms up), then --repeats timed runs; the median is reported. Prints
markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import machine

VOCAB = 4096


def checkpoint(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import Qwen3_5TextConfig, Qwen3_5ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=64, linear_value_head_dim=64, intermediate_size=768,
                            max_position_embeddings=4096, layer_types=["linear_attention"] * 3 + ["full_attention"]
                            + ["linear_attention"] * 3 + ["full_attention"], eos_token_id=0)
    Qwen3_5ForCausalLM(cfg).save_pretrained(directory)
    tok = Tokenizer(WordLevel(vocab={"<eos>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="<eos>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<eos>"}))


def task(directory: Path, docs: int) -> None:
    rng = np.random.default_rng(0)

    def words(n):
        return " ".join(f"w{i}" for i in rng.integers(1, VOCAB, n))
    with open(directory / "mc.jsonl", "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"question": words(int(rng.integers(50, 300))),
                                "choices": [words(int(rng.integers(1, 6))) for _ in range(4)], "answer": 0}) + "\n")
    (directory / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import lm_eval
    from lm_eval.tasks import TaskManager

    from gdnx.evaluation import GdnxLM
    from gdnx.inference import load

    root = Path(tempfile.mkdtemp(prefix="gdnx-eval-bench-"))
    checkpoint(root / "model")
    (root / "tasks").mkdir()
    task(root / "tasks", args.docs)
    manager = TaskManager(include_path=str(root / "tasks"))
    requests = 4 * args.docs

    def run(model, **kw):
        return lm_eval.simple_evaluate(model=model, tasks=["bench_mc"], task_manager=manager, log_samples=False,
                                       **kw)

    gdnx_lm = GdnxLM(load(root / "model", [], "eval"), batch_size=args.batch_size, progress=False)
    from lm_eval.models.huggingface import HFLM
    hf_lm = HFLM(pretrained=str(root / "model"), dtype="float32", device="cpu", batch_size=args.batch_size)
    times = {}
    for name, lm in (("gdnx eval", gdnx_lm), ("lm-eval hf", hf_lm)):
        t0 = time.perf_counter()
        first = run(lm)
        times[name + " first"] = time.perf_counter() - t0
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = run(lm)
            runs.append(time.perf_counter() - t0)
        times[name] = statistics.median(runs)
        assert result["results"]["bench_mc"]["acc,none"] == first["results"]["bench_mc"]["acc,none"]
    print(f"{machine()}; `python -m benchmarks.serving.evaluation --docs {args.docs} --batch-size "
          f"{args.batch_size}`; {requests} loglikelihood requests, median of {args.repeats}\n")
    print("| backend | first run (compiles) | requests/s (median) | vs lm-eval hf |")
    print("|---|---:|---:|---:|")
    for name in ("gdnx eval", "lm-eval hf"):
        print(f"| {name} | {times[name + ' first']:.1f} s | {requests / times[name]:.1f} | "
              f"{times['lm-eval hf'] / times[name]:.2f}x |")


if __name__ == "__main__":
    main()
