"""What a run's data source says about the run after it: the tokenizer its
text was read with, which export, generate and serve take up."""

import pytest

from gdnx.config import load_config
from gdnx.data.source import run_tokenizer


@pytest.mark.parametrize("source,extra", [("text", []), ("sft", []), ("rl", ["train.rl.group_size=2"])])
def test_a_runs_tokenizer_is_the_one_its_text_was_read_with(tmp_path, source, extra):
    config = load_config("tiny", [f"data.source={source}", "data.path=prompts.jsonl", "model.vocab_size=300",
                                  f"data.tokenizer={tmp_path / 'tokenizer.json'}", *extra])
    assert run_tokenizer(config) == tmp_path / "tokenizer.json"
    assert run_tokenizer(config.model_copy(update={"data": config.data.model_copy(update={"tokenizer": None})})) \
        is None  # raw bytes
    assert run_tokenizer(load_config("tiny", [])) is None  # MQAR's ids are no text
