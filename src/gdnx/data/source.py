"""Batches by step number: batch s depends only on (seed, s), so a resumed
run sees exactly the data an uninterrupted one would.

MQAR is generated inside the compiled step (a function of the step
number). Text is tokenized into memory-mapped shards first (`gdnx
prepare`, or automatically for data.source=text, by process 0 of a run
while the others wait) and read on the host, packed documents per row
(gdnx.data.tokens): nothing of the corpus enters the compiled program.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax

from gdnx.config.schema import Config, DataConfig
from gdnx.data.mqar import mqar_batch
from gdnx.data.prepare import prepare_corpus, prepared_tokenizer
from gdnx.data.text import Tokenizer, make_tokenizer
from gdnx.data.sft import ExampleRows, prepare_sft
from gdnx.data.tokens import PackedRows, Rows, TokenShards
from gdnx.distributed import wait_for_first

EVAL_SEED_OFFSET = 1_000_003
PREPARE_TIMEOUT_S = 24 * 3600  # how long the other processes wait for process 0 to tokenize data.path


class Batch(NamedTuple):
    inputs: jax.Array   # int32 [B, T]
    targets: jax.Array  # int32 [B, T]
    mask: jax.Array     # bool [B, T]: positions that count in loss and accuracy
    first: jax.Array    # bool [B, T]: MQAR first queries (all of mask for text)
    segments: jax.Array | None = None      # int32 [B, T]: document of each token (packed text rows)
    target_bytes: jax.Array | None = None  # int32 [B, T]: UTF-8 bytes of each target (bits per byte)


class Source(NamedTuple):
    """train(seed) / evaluation(seed): step -> batch. In-graph sources (MQAR)
    give jit-able functions of a traced step; host sources (text) give
    (seed, step, rows) -> numpy rows, read outside the compiled step."""
    in_graph: bool
    train: Callable
    evaluation: Callable | None
    tokenizer: Tokenizer | None
    notes: tuple[str, ...] = ()  # what a run's log says of its data (SFT: examples dropped, padding)


def _mqar(data_cfg: DataConfig, batch_size: int) -> Source:
    def batches(seed):
        base = jax.random.fold_in(jax.random.key(seed), 0x5EED)

        def batch_fn(step):
            return Batch(*mqar_batch(jax.random.fold_in(base, step), batch_size, data_cfg.seq_len,
                                     data_cfg.num_pairs, data_cfg.num_keys, data_cfg.num_values))
        return batch_fn
    return Source(True, batches, lambda seed: batches(seed + EVAL_SEED_OFFSET), None)


def prepared_dir(data_cfg: DataConfig, out_dir: Path) -> Path:
    """Where data.source=text keeps its shards: <out_dir>/data (made from
    data.path on first use; a gdnx prepare directory for data.source=tokens)."""
    assert data_cfg.path is not None  # DataConfig requires it for text sources
    return Path(data_cfg.path) if data_cfg.source == "tokens" else out_dir / "data"


def make_source(data_cfg: DataConfig, batch_size: int, vocab_size: int, *, out_dir: Path | None = None,
                evaluate: bool = True, progress: Callable[[int, int], None] | None = None,
                resuming: bool = False) -> Source:
    """The data of a run. Text is prepared into <out_dir>/data first
    (data.source=text) or read from a prepared directory (data.source=tokens).
    resuming: the run has checkpoints, so text already prepared must not
    change under it."""
    if data_cfg.source == "mqar":
        return _mqar(data_cfg, batch_size)
    assert data_cfg.path is not None
    directory = prepared_dir(data_cfg, out_dir or Path("."))
    if data_cfg.source in ("text", "sft"):
        # with several processes, process 0 prepares and the others wait for it (never two writers)
        if jax.process_index() == 0:
            prepare = prepare_corpus if data_cfg.source == "text" else prepare_sft
            try:
                prepare([Path(data_cfg.path)], directory, tokenizer=data_cfg.tokenizer, eos_token=data_cfg.eos_token,
                        val_fraction=data_cfg.val_fraction, progress=progress, keep=resuming)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"data.path: {e}") from None
            except ValueError as e:
                raise ValueError(e if str(e).startswith("data.") else f"data.path: {e}") from None
        wait_for_first("prepare", PREPARE_TIMEOUT_S)
    train_shards = TokenShards(directory, "train")
    if train_shards.vocab_size > vocab_size:
        raise ValueError(f"model.vocab_size: the tokenizer has {train_shards.vocab_size} tokens, "
                         f"the model {vocab_size}")
    tokenizer = make_tokenizer(data_cfg.tokenizer) if data_cfg.source in ("text", "sft") else None
    notes: list[str] = []

    def rows(shards: TokenShards) -> Rows:
        if data_cfg.source != "sft":
            return PackedRows(shards, data_cfg.seq_len)
        made = ExampleRows(shards, data_cfg.seq_len, packing=data_cfg.sft_packing, overlong=data_cfg.sft_overlong)
        fit, split = made.fit, "training" if shards.split == "train" else "validation"
        for count, what in ((fit.dropped, "dropped"), (fit.truncated, "truncated to it"),
                            (fit.unscored, "dropped: cut to a row, no response token was left")):
            if count:
                notes.append(f"data: {count} of the {len(shards.ends)} {split} examples are longer than "
                             f"data.seq_len + 1 = {data_cfg.seq_len + 1} tokens: {what} (data.sft_overlong)")
        notes.append(f"data: {len(shards.ends) - fit.dropped - fit.unscored} {split} examples in {fit.rows} rows of "
                     f"{data_cfg.seq_len + 1} tokens, {100 * fit.padding:.1f}% padding "
                     f"({'packed' if data_cfg.sft_packing else 'one per row'})")
        return made

    train_rows = rows(train_shards)
    eval_rows = None
    if evaluate:
        val = TokenShards(directory, "val")
        if len(val) < 2:
            raise ValueError(f"data.val_fraction: the validation split of {directory} holds no text to evaluate "
                             "on; raise data.val_fraction (or give more documents), or set train.eval_every=0")
        eval_rows = rows(val)
    evaluation = None if eval_rows is None else (lambda seed: (eval_rows, seed + EVAL_SEED_OFFSET))
    return Source(False, lambda seed: (train_rows, seed), evaluation, tokenizer, tuple(notes))


def run_tokenizer(config: Config) -> Path | None:
    """The tokenizer.json a run's text was tokenized with (None: raw bytes
    or MQAR, which have none)."""
    if config.data.source in ("text", "sft", "rl"):
        return None if config.data.tokenizer is None else Path(config.data.tokenizer)
    if config.data.source == "tokens":
        found = prepared_tokenizer(Path(config.data.path or ""))
        return None if found is None else Path(found)
    return None
