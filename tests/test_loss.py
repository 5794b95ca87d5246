"""The blocked cross-entropy equals the whole-vocabulary one (float32,
relative 1e-6 on the loss and every gradient), at any block size,
padded lengths, masks, tied and untied heads."""

import jax
import jax.numpy as jnp
import pytest

from gdnx.loss import block_length, blocked_cross_entropy
from gdnx.measure import relative_error


def _dense(hidden, w, targets, mask):
    logits = jnp.einsum("bth,hv->btv", hidden, w)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask)


@pytest.mark.parametrize("block", [None, 1, 4, 16])
@pytest.mark.parametrize("tied", [False, True])
def test_blocked_equals_dense(block, tied):
    b, t, h, v = 3, 13, 8, 50
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (b, t, h))
    w = jax.random.normal(keys[1], (v, h) if tied else (h, v))
    targets = jax.random.randint(keys[2], (b, t), 0, v)
    mask = jax.random.bernoulli(keys[3], 0.7, (b, t))
    head = (lambda x, w: jnp.einsum("bth,vh->btv", x, w)) if tied else (lambda x, w: x @ w)

    def blocked(hidden, w):
        s = blocked_cross_entropy(hidden, lambda x: head(x, w), targets, mask, mask, vocab=v, block=block)
        return s.nll / s.tokens

    ref, ref_grads = jax.value_and_grad(lambda x, w: _dense(x, w.T if tied else w, targets, mask), (0, 1))(hidden, w)
    got, grads = jax.jit(jax.value_and_grad(blocked, (0, 1)))(hidden, w)
    assert relative_error(got, ref) <= 1e-6
    for g, r in zip(grads, ref_grads):
        assert relative_error(g, r) <= 1e-6


def test_hits_and_counts():
    hidden = jnp.eye(4)[None]  # position i's logits peak at vocabulary entry i
    s = blocked_cross_entropy(hidden, lambda x: x * 10.0, jnp.asarray([[0, 1, 3, 3]]), jnp.ones((1, 4), bool),
                              jnp.asarray([[True, False, False, True]]), vocab=4, block=2)
    assert (float(s.hits), float(s.tokens), float(s.first_hits), float(s.first_tokens)) == (3.0, 4.0, 2.0, 2.0)


def test_block_length_fits_the_budget():
    assert block_length(16, 512, 151_936) == 32  # 16 x 32 x 151,936 float32 = 311 MB <= 512 MiB
    assert block_length(16, 128, 256) == 128  # a small vocabulary: one block
    assert block_length(1, 5, 10) == 8
    assert block_length(4096, 4096, 2 ** 20) == 1
    assert block_length(16, 100, 256) == 128


@pytest.mark.parametrize("block", [None, 1, 5, 16])
def test_position_scores_equal_the_whole_vocabularys(block):
    """Per position, blocked (5 does not divide 13: padded) against one
    log_softmax over the whole [B, T, vocab]: the same operations per row,
    so equal to float32 rounding (1e-6), the same argmax and top ids."""
    from gdnx.loss import position_scores

    b, t, h, v = 3, 13, 8, 50
    keys = jax.random.split(jax.random.key(1), 3)
    hidden = jax.random.normal(keys[0], (b, t, h))
    w = jax.random.normal(keys[1], (h, v))
    targets = jax.random.randint(keys[2], (b, t), 0, v)
    logp = jax.nn.log_softmax(hidden @ w, axis=-1)
    top, ids = jax.lax.top_k(logp, 3)
    got = position_scores(hidden, lambda x: x @ w, targets, vocab=v, top=3, block=block)
    assert got.chosen.shape == (b, t) and got.top_ids.shape == (b, t, 3)
    assert relative_error(got.chosen, jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]) < 1e-6
    assert relative_error(got.top, top) < 1e-6 and (got.top_ids == ids).all()
    assert (got.greedy == (jnp.argmax(logp, -1) == targets)).all()
    assert position_scores(hidden, lambda x: x @ w, targets, vocab=v).top_ids.shape == (b, t, 0)
