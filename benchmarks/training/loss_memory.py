"""Memory of training at a large vocabulary: the blocked loss (gdnx.loss)
against the one-hot loss it replaced.

    python -m benchmarks.training.loss_memory

The README's tokenizer example: the tiny model (width 64) with a
151,936-token vocabulary, sequence 512 x batch 16, and 2048 x batch 8. For
each: the peak resident memory of `gdnx train` running 3 steps (a
subprocess; ru_maxrss), and both losses' compiled train step
(memory_analysis: temporaries + arguments + outputs), which needs no run:
the one-hot loss was killed at 20.3 GB on this machine before its first
step. Prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import machine

ROOT = Path(__file__).resolve().parents[2]

VOCAB = 151_936
SHAPES = ((512, 16), (2048, 8))


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def _overrides(work: Path, seq: int, batch: int) -> list[str]:
    return ["data.source=text", f"data.path={work / 'corpus.txt'}", f"data.tokenizer={work / 'tokenizer.json'}",
            f"model.vocab_size={VOCAB}", f"data.seq_len={seq}", f"train.batch_size={batch}", "train.steps=3",
            "train.warmup_steps=1", "train.eval_every=0", "train.checkpoint_every=3", "train.target_accuracy=null",
            "data.val_fraction=0.0",
            f"train.out_dir={work / f'run_{seq}'}"]


def _peak_rss_of_training(work: Path, seq: int, batch: int) -> int:
    """Peak resident bytes of a `gdnx train` process (ru_maxrss is in KiB)."""
    code = ("import resource, sys; from gdnx.cli import main; rc = main(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "train", "tiny", *_overrides(work, seq, batch)],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("MAXRSS"))) * 1024


def _one_hot_loss(model, batch, aux_coef):
    """The loss gdnx used before gdnx.loss: whole [B, T, vocab] logits."""
    import jax
    import jax.numpy as jnp

    out = model.forward(batch.inputs)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.sum(logp * jax.nn.one_hot(batch.targets, logp.shape[-1], dtype=logp.dtype), axis=-1)
    mask = batch.mask.astype(jnp.float32)
    loss = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    hit = (jnp.argmax(out.logits, axis=-1) == batch.targets).astype(jnp.float32)
    return loss + aux_coef * out.aux_loss, {"loss": loss, "accuracy": jnp.sum(hit * mask) / jnp.sum(mask)}


def _compiled_bytes(work: Path, seq: int, batch: int, one_hot: bool) -> int:
    import jax.numpy as jnp

    from gdnx.training import loop as train_module, step as train_step
    from gdnx.config import load_config

    if one_hot:
        train_step.loss_and_metrics = _one_hot_loss
    trainer = train_module.Trainer(load_config("tiny", _overrides(work, seq, batch)))
    opt = trainer.init_opt_state(trainer.params)
    batch = trainer.device_batch(trainer.host_batch("train", 0))
    mem = trainer.step_fn.lower(trainer.params, opt, jnp.asarray(0, jnp.int32), batch).compile().memory_analysis()
    return mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--compiled":  # one loss per process: its own memory
        print(_compiled_bytes(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4].split(",")[0]),
                              sys.argv[4].endswith("one_hot")))
        return
    work = Path(tempfile.mkdtemp())
    _tokenizer(work / "tokenizer.json")
    words = " ".join(f"w{1 + (i * 7919) % (VOCAB - 1)}" for i in range(200_000))
    (work / "corpus.txt").write_text(words)
    print(f"{machine()}; `python -m benchmarks.training.loss_memory`")
    print("| sequence x batch | gdnx train peak RSS (blocked loss) | compiled step, blocked | compiled step, one-hot |")
    print("|---|---|---|---|")
    for seq, batch in SHAPES:
        rss = _peak_rss_of_training(work, seq, batch)
        compiled = {}
        for kind in ("blocked", "one_hot"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.training.loss_memory", "--compiled", str(work),
                                  str(seq), f"{batch},{kind}"], capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            compiled[kind] = int(out.stdout.split()[-1])
        gb = lambda x: f"{x / 1e9:.2f} GB"  # noqa: E731
        print(f"| {seq} x {batch} | {gb(rss)} | {gb(compiled['blocked'])} | {gb(compiled['one_hot'])} |")


if __name__ == "__main__":
    main()
