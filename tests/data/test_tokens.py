"""Packed rows from prepared shards: a function of (seed, step, row), whole
documents with their boundaries, long documents in row-long pieces,
targets across a boundary not scored, a process's rows its own."""

import json

import numpy as np

from gdnx.data.prepare import prepare_corpus
from gdnx.data.text import BYTES_EOS
from gdnx.data.tokens import PackedRows, Prefetcher, TokenShards, host_batch

T = 32


def _rows(tmp_path):
    docs = [f"document {i} " * (i % 4 + 1) for i in range(60)] + ["L" * (3 * T + 5)]  # one longer than 3 rows
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    prepare_corpus([tmp_path / "c.jsonl"], tmp_path / "out", val_fraction=0.0)
    return PackedRows(TokenShards(tmp_path / "out", "train"), T)


def test_rows_are_a_function_of_seed_step_and_row(tmp_path):
    rows = _rows(tmp_path)
    whole = host_batch(rows, 0, 7, range(8))
    halves = [host_batch(rows, 0, 7, range(0, 4)), host_batch(rows, 0, 7, range(4, 8))]
    for a, b0, b1 in zip(whole, *halves):
        np.testing.assert_array_equal(a, np.concatenate([b0, b1]))
    assert not np.array_equal(whole.inputs, host_batch(rows, 0, 8, range(8)).inputs)
    assert not np.array_equal(whole.inputs, host_batch(rows, 1, 7, range(8)).inputs)


def test_documents_and_boundaries(tmp_path):
    rows = _rows(tmp_path)
    batch = host_batch(rows, 3, 1, range(64))
    assert batch.inputs.shape == (64, T)
    change = batch.segments[:, 1:] != batch.segments[:, :-1]
    # a new document starts right after an end-of-document token, and nowhere else
    np.testing.assert_array_equal(change, batch.inputs[:, :-1] == BYTES_EOS)
    # the target after an EOS (another document's first token) is not scored
    assert not batch.mask[batch.inputs == BYTES_EOS].any()
    assert batch.mask.mean() > 0.8
    assert (batch.segments[:, 0] == 0).all()
    # the long document's pieces: rows that start inside it
    starts = {int(s) for s in rows.piece_starts}
    long_start = int(rows.shards.ends[-2])
    assert {long_start, long_start + T, long_start + 2 * T, long_start + 3 * T} <= starts
    np.testing.assert_array_equal(batch.target_bytes, np.where(batch.targets == BYTES_EOS, 0, 1))


def test_prefetcher_gives_the_same_batches_in_order(tmp_path):
    rows = _rows(tmp_path)
    fetch = Prefetcher(lambda s: host_batch(rows, 0, s, range(4)), start=5)
    for step in (5, 6, 7):
        np.testing.assert_array_equal(fetch.get(step).inputs, host_batch(rows, 0, step, range(4)).inputs)
    fetch.close()
