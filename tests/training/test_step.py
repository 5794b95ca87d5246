"""The train step: gradient accumulation equals the whole batch."""

import pytest

from gdnx.config import load_config
from gdnx.training import Trainer
from tests.helpers.configs import SMALL_RUN


@pytest.mark.parametrize("count", [2, 4, 8])
def test_accumulated_gradients_equal_the_whole_batch(tmp_path, count):
    """Loss, metrics and the gradient of `count` micro-batches match one pass
    over the batch of 8 within 1e-6 relative (float32: the same sums in
    another order); each gradient leaf within 1e-5, since a leaf summed
    from terms that nearly cancel (a per-head decay parameter's, measured
    1.6e-6 at 8 micro-batches) loses relative precision in any order."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdnx.measure import relative_error
    from gdnx.training.step import accumulated_gradients, loss_and_metrics

    trainer = Trainer(load_config("tiny", SMALL_RUN + ["train.batch_size=8", f"train.out_dir={tmp_path}"]))
    batch = trainer.source.train(0)(jnp.int32(3))

    def loss_fn(p, data, totals, share):
        return loss_and_metrics(nnx.merge(trainer.graphdef, p), data, 0.0, totals)

    def accumulate(n):
        return jax.jit(lambda p: accumulated_gradients(loss_fn, p, batch, n))(trainer.params)
    (loss, metrics), grads = accumulate(1)
    (loss_n, metrics_n), grads_n = accumulate(count)
    assert relative_error(loss_n, loss) <= 1e-6
    for k in metrics:
        assert relative_error(metrics_n[k], metrics[k]) <= 1e-6, k
    flat = [jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)]) for g in (grads_n, grads)]
    assert relative_error(*flat) <= 1e-6
    for a, b in zip(jax.tree.leaves(grads_n), jax.tree.leaves(grads), strict=True):
        assert relative_error(a, b) <= 1e-5
