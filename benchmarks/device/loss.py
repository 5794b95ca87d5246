"""The language-model head's loss on an accelerator: gdnx's blocked
cross-entropy (gdnx.loss: logits made a block of positions at a time,
float32, reduced and dropped) against tokamax's fused linear softmax
cross-entropy (its Pallas TPU kernel: the logits never leave the chip's
VMEM), forward and backward, at Qwen3.5-0.8B's head by default.

    python -m benchmarks.device.loss [--tokens 4096] [--hidden 1024] [--vocab 248320] [--out FILE]

bfloat16 hidden states and weights, float32 logits and loss, grads of the
hidden states and the weights; every row's loss and gradients compared
with the first row's (the blocked loss at its default block), relative
errors. The masked positions (a quarter here) go to tokamax's kernel as
zero rows, which it scores log(vocab) each, with no gradient: subtracted
after.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import Table, machine, median_seconds, write
from gdnx.loss import blocked_cross_entropy
from gdnx.measure import relative_error


def blocked(block: int | None, vocab: int):
    def loss(h, w, targets, mask):
        sums = blocked_cross_entropy(h[None], lambda x: jnp.einsum("bth,vh->btv", x, w,
                                                                   preferred_element_type=jnp.float32),
                                     targets[None], mask[None], jnp.zeros_like(mask)[None], vocab=vocab, block=block)
        return sums.nll
    return loss


def fused(implementation: str, vocab: int):
    import tokamax

    def loss(h, w, targets, mask):
        x = jnp.where(mask[:, None], h, jnp.zeros_like(h))
        total = tokamax.linear_softmax_cross_entropy_loss(x, targets, w.T, reduction="sum",
                                                          implementation=implementation)
        return total - jnp.sum(~mask) * math.log(vocab)
    return loss


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.argv = sys.argv[:1]  # tokamax reads absl flags from the command line
    t, hdim, v = args.tokens, args.hidden, args.vocab
    keys = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(keys[0], (t, hdim), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (v, hdim), jnp.float32) * 0.02).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (t,), 0, v)
    mask = jax.random.uniform(keys[3], (t,)) > 0.25
    flops = 3 * 2 * t * hdim * v
    table = Table(f"# LM head loss, forward + backward (grads of hidden and weights), T={t} H={hdim} V={v}, "
                  f"bf16 inputs; {machine()}",
                  ["implementation", "fwd+bwd ms", "forward ms", "TFLOP/s", "loss rel err", "dh rel err",
                   "dw rel err"], numeric=[False] + [True] * 6)
    rows = [("blocked, default block", blocked(None, v)), ("blocked, 512 positions", blocked(512, v)),
            ("blocked, 1024 positions", blocked(1024, v)), ("tokamax mosaic_tpu", fused("mosaic_tpu", v)),
            ("tokamax xla", fused("xla", v))]
    ref = None
    for name, loss in rows:
        try:
            grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            fwd = jax.jit(loss)
            value, (dh, dw) = grad(h, w, targets, mask)
            if ref is None:
                ref = (value, dh, dw)
            errs = [relative_error(a, b) for a, b in zip((value, dh, dw), ref)]
            total = median_seconds(lambda: grad(h, w, targets, mask), args.repeats)
            forward = median_seconds(lambda: fwd(h, w, targets, mask), args.repeats)
            table.row(name, f"{total * 1e3:.2f}", f"{forward * 1e3:.2f}", f"{flops / total / 1e12:.1f}",
                       *(f"{e:.1e}" for e in errs))
        except Exception as e:  # one failing variant does not cost the run
            table.row(name, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", "", "", "", "", "")
    if args.out:
        write(args.out, table)


if __name__ == "__main__":
    main()
