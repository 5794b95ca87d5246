"""The MQAR generator: layout, answers, masks, determinism by step."""

import jax
import numpy as np

from gdnx.config import load_config
from gdnx.data import make_source
from gdnx.data.mqar import mqar_batch


def test_rows_recall_their_context():
    x, y, mask, first = (np.asarray(a) for a in mqar_batch(jax.random.key(3), 8, 128, 16, 128, 128))
    assert x.shape == y.shape == mask.shape == first.shape == (8, 128)
    for row in range(8):
        keys, values = x[row, 0:32:2], x[row, 1:32:2]
        assert len(set(keys)) == 16 and keys.max() < 128 and values.min() >= 128
        table = dict(zip(keys, values))
        answers = np.flatnonzero(mask[row])
        assert len(answers) == (129 - 32) // 2
        for t in answers:  # each scored position holds a query key whose target is its value
            assert y[row, t] == table[x[row, t]]
        seen = set()
        for t in answers:
            assert first[row, t] == (x[row, t] not in seen)
            seen.add(x[row, t])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_batches_depend_on_step_only():
    cfg = load_config("tiny")
    source = make_source(cfg.data, 4, vocab_size=cfg.model.vocab_size)
    assert source.tokenizer is None and source.in_graph
    batches = source.train
    fn = batches(0)
    a, b, c = fn(5), batches(0)(5), fn(6)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert not np.array_equal(a.inputs, c.inputs)
    assert not np.array_equal(a.inputs, batches(1)(5).inputs)
