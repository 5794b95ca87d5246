"""SFT examples: tokens and the loss mask, prepared shards, whole examples
packed into rows (or one per row), over-long ones dropped or truncated and
counted, and the batch mask that keeps the loss on the responses."""

import json

import numpy as np
import pytest

from gdnx.data.sft import ExampleEncoder, ExampleRows, prepare_sft
from gdnx.data.tokens import TokenShards, host_batch
from tests.helpers.hf_models import write_chat_tokenizer


def _write(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))


def _examples(n, rng):
    out = []
    for i in range(n):
        words = lambda k: " ".join(f"w{int(x)}" for x in rng.integers(6, 97, k))  # noqa: E731
        if i % 2:
            out.append({"prompt": words(int(rng.integers(2, 9))), "completion": " " + words(int(rng.integers(1, 9)))})
        else:
            out.append({"messages": [{"role": "user", "content": words(int(rng.integers(1, 6)))},
                                     {"role": "assistant", "content": words(int(rng.integers(1, 6)))}]})
    return out


def test_the_mask_marks_the_responses(tmp_path):
    write_chat_tokenizer(tmp_path)
    enc = ExampleEncoder(str(tmp_path / "tokenizer.json"), None)
    ids, scored = enc.encode({"prompt": "w10 w11", "completion": " w12 w13"}, "x")
    assert ids.tolist() == [10, 11, 12, 13, 0] and scored.tolist() == [0, 0, 1, 1, 1]  # the end token counts
    ids, scored = enc.encode({"messages": [{"role": "user", "content": "w20"},
                                           {"role": "assistant", "content": "w30 w31"}]}, "x")
    # <|im_start|> user w20 <|im_end|> <|im_start|> assistant | w30 w31 <|im_end|>
    assert ids.tolist() == [1, 4, 20, 2, 1, 5, 30, 31, 2] and scored.tolist() == [0] * 6 + [1] * 3


@pytest.mark.parametrize("line, message", [
    ({"text": "w1"}, 'line 2: expected {"messages": [...]} or string "prompt" and "completion" fields'),
    ({"messages": [{"role": "user", "content": "w9"}]}, "line 2: no assistant message"),
    ({"messages": [{"role": "user"}]}, 'line 2: message 1 must be an object with a string "role" and "content"'),
    ({"messages": [{"role": "tool", "content": "w9"}, {"role": "assistant", "content": "w9"}]},
     "line 2: the chat template refused the messages: unknown role tool"),
    ({"prompt": "w1", "completion": 3}, 'line 2: expected {"messages": [...]} or string "prompt"'),
])
def test_bad_examples_are_refused_by_line(tmp_path, line, message):
    write_chat_tokenizer(tmp_path / "tok")
    _write(tmp_path / "d.jsonl", [{"prompt": "w1", "completion": " w2"}, line])
    with pytest.raises(ValueError, match=message.replace("[", "\\[").replace("]", "\\]")):
        prepare_sft([tmp_path / "d.jsonl"], tmp_path / "out", tokenizer=str(tmp_path / "tok" / "tokenizer.json"))


def test_messages_need_a_tokenizer_with_a_template(tmp_path):
    _write(tmp_path / "d.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match="line 1: \"messages\" are rendered with a chat template"):
        prepare_sft([tmp_path / "d.jsonl"], tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl line 1: not a JSON object"):
        prepare_sft([tmp_path / "bad.jsonl"], tmp_path / "out2")


def _prepared(tmp_path, n=40, val_fraction=0.1):
    write_chat_tokenizer(tmp_path / "tok")
    examples = _examples(n, np.random.default_rng(0))
    _write(tmp_path / "d.jsonl", examples)
    meta = prepare_sft([tmp_path / "d.jsonl"], tmp_path / "out", tokenizer=str(tmp_path / "tok" / "tokenizer.json"),
                       val_fraction=val_fraction)
    return examples, meta


def test_prepared_shards_hold_every_example_and_rerun_does_nothing(tmp_path):
    examples, meta = _prepared(tmp_path)
    assert meta["splits"]["val"]["documents"] == 4 and meta["splits"]["train"]["documents"] == 36
    enc = ExampleEncoder(str(tmp_path / "tok" / "tokenizer.json"), None)
    shards = TokenShards(tmp_path / "out", "train")
    starts = np.concatenate([[0], shards.ends[:-1]])
    train = [e for i, e in enumerate(examples) if (i + 1) % 10]
    for (a, b), example in zip(zip(starts, shards.ends), train, strict=True):
        ids, scored = enc.encode(example, "x")
        assert shards.tokens[a:b].tolist() == ids.tolist() and shards.scored[a:b].tolist() == scored.tolist()
    again = prepare_sft([tmp_path / "d.jsonl"], tmp_path / "out", tokenizer=str(tmp_path / "tok" / "tokenizer.json"),
                        val_fraction=0.1)
    assert again["up_to_date"]


@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_whole_examples(tmp_path, packing):
    _prepared(tmp_path)
    shards = TokenShards(tmp_path / "out", "train")
    rows = ExampleRows(shards, 31, packing=packing)
    starts = np.concatenate([[0], shards.ends[:-1]])
    whole = {tuple(shards.tokens[a:b].tolist()) for a, b in zip(starts, shards.ends)}
    for index in range(rows.rows * 2):
        row = rows.row(0, 0, index)
        pieces = [row.tokens[row.segments == s].tolist() for s in np.unique(row.segments[row.valid])]
        assert all(tuple(p) in whole for p in pieces), "an example was split"
        assert packing or len(pieces) == 1
    assert (rows.fit.padding < ExampleRows(shards, 31, packing=False).fit.padding) == packing or not packing


def test_overlong_examples_are_dropped_or_truncated_and_counted(tmp_path):
    _prepared(tmp_path)
    shards = TokenShards(tmp_path / "out", "train")
    sizes = np.diff(np.concatenate([[0], shards.ends]))
    length = int(np.median(sizes))  # rows of length + 1 tokens: the longer half does not fit
    longer = int((sizes > length + 1).sum())
    dropped = ExampleRows(shards, length, overlong="drop")
    assert dropped.fit.dropped == longer > 0 and dropped.fit.truncated == 0
    cut = ExampleRows(shards, length, overlong="truncate")
    assert cut.fit.truncated + cut.fit.unscored == longer and cut.fit.dropped == 0
    starts = np.concatenate([[0], shards.ends[:-1]])
    unscored = sum(not shards.scored[a + 1:a + length + 1].any() for a, n in zip(starts, sizes) if n > length + 1)
    assert cut.fit.unscored == unscored  # cut to a row with no response token left: dropped and counted
    assert all(cut.row(0, 0, i).valid.sum() <= length + 1 for i in range(20))
    with pytest.raises(ValueError, match="data.seq_len: every one of the 36 examples"):
        ExampleRows(shards, 1)
    # every example cut before its response: refused, never trained with loss 0
    prompt_lengths = [int(np.argmax(shards.scored[a:b] != 0)) for a, b in zip(starts, shards.ends)]
    with pytest.raises(ValueError, match="none of the 36 examples of the train split keeps a scored"):
        ExampleRows(shards, min(prompt_lengths) - 2, overlong="truncate")


def test_the_batch_mask_scores_response_targets_only(tmp_path):
    _prepared(tmp_path)
    shards = TokenShards(tmp_path / "out", "train")
    rows = ExampleRows(shards, 63)
    batch = host_batch(rows, 0, 3, range(4))
    for r in range(4):
        row = rows.row(0, 3, r)
        expect = row.scored[1:] & row.valid[1:] & (row.segments[1:] == row.segments[:-1])
        np.testing.assert_array_equal(batch.mask[r], expect)
        assert batch.mask[r].sum() > 0
