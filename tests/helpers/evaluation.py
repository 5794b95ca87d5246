"""A tiny checkpoint with local lm-evaluation-harness tasks, and reading
what `gdnx eval` wrote."""

import json

import numpy as np

from tests.helpers.hf_models import random_hf_model, sentence, word, write_chat_tokenizer


def write_model_and_tasks(root):
    """A tiny checkpoint with a word-level tokenizer, and three local tasks."""
    path = root / "model"
    random_hf_model("qwen3_5", scale=5.0).save_pretrained(path)
    write_chat_tokenizer(path)
    rng = np.random.default_rng(0)
    tasks = root / "tasks"
    tasks.mkdir()
    with open(tasks / "mc.jsonl", "w") as f:
        for _ in range(6):
            choices = [sentence(rng, int(rng.integers(1, 4))) for _ in range(3)]
            f.write(json.dumps({"question": sentence(rng, int(rng.integers(3, 40))), "choices": choices,
                                "answer": int(rng.integers(0, 3))}) + "\n")
    with open(tasks / "text.jsonl", "w") as f:
        for n in (5, 30, 90):  # the last one longer than a scoring bucket's first size
            f.write(json.dumps({"text": sentence(rng, n)}) + "\n")
    with open(tasks / "gen.jsonl", "w") as f:
        for _ in range(3):
            f.write(json.dumps({"question": sentence(rng, 8), "answer": word(9)}) + "\n")
    common = "test_split: test\ndataset_path: json\n"
    (tasks / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (tasks / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'text.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (tasks / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['w7']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return path, tasks


def read_samples(out_dir, task) -> list[dict]:
    """The samples lm-eval wrote for `task` under out_dir."""
    files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(x) for x in files[0].read_text().splitlines()]


def first_logprob(resp) -> float:
    """The log-probability in a loglikelihood response, however nested."""
    while isinstance(resp, (list, tuple)):
        resp = resp[0]
    return float(resp)
