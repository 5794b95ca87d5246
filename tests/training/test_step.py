"""The train step: gradient accumulation equals the whole batch."""

import pytest

from gdnx.config import load_config
from gdnx.training import Trainer
from tests.helpers.configs import SMALL_RUN
from tests.helpers.tiers import fast_only


@pytest.mark.parametrize("count", fast_only([2, 4, 8], lambda n: n == 2))
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


@pytest.mark.slow
def test_the_mtp_loss_is_the_modules_cross_entropy_and_trains_it(tmp_path):
    """train.mtp_loss_weight over a model with a multi-token prediction
    module (model.mtp_num_layers=2, chained): each depth's loss is the
    cross-entropy of its teacher-forced logits at the targets k + 1 ahead
    (the mask's counted positions), summed over the main loss's token count,
    computed here from mtp_hidden and the head directly; the loss adds their
    mean at the weight; micro-batches add up to the whole batch; the
    module's parameters get a gradient, and without the weight none."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gdnx.measure import relative_error
    from gdnx.training.step import accumulated_gradients, batch_totals, loss_and_metrics

    trainer = Trainer(load_config("tiny", SMALL_RUN + ["train.batch_size=8", f"train.out_dir={tmp_path}",
                                                       "model.mtp_num_layers=2"]))
    batch = trainer.source.train(0)(jnp.int32(3))
    model = nnx.merge(trainer.graphdef, trainer.params)
    loss, metrics = loss_and_metrics(model, batch, 0.0, mtp_weight=0.3)
    plain, _ = loss_and_metrics(model, batch, 0.0)
    tokens = batch_totals(batch).tokens
    hidden = model.mtp_hidden(model.hidden_states(batch.inputs).hidden, batch.inputs)
    want = []
    for k, h in enumerate(hidden):
        logits = np.asarray(model.logits(h), np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        tgt = np.asarray(batch.targets[:, k + 1:])
        nll = lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
        want.append(float(np.sum(nll * np.asarray(batch.mask[:, k + 1:])) / float(tokens)))
        assert relative_error(metrics[f"mtp_loss_{k + 1}"], want[-1]) <= 1e-5
    assert relative_error(loss, float(plain) + 0.3 * np.mean(want)) <= 1e-6

    def loss_fn(p, data, totals, share):
        return loss_and_metrics(nnx.merge(trainer.graphdef, p), data, 0.0, totals, 0.3)

    (whole, _), grads = jax.jit(lambda p: accumulated_gradients(loss_fn, p, batch, 1))(trainer.params)
    (split, _), _ = jax.jit(lambda p: accumulated_gradients(loss_fn, p, batch, 2))(trainer.params)
    assert relative_error(split, whole) <= 1e-6
    assert float(jnp.abs(grads["mtp"]["fc"]["kernel"][...]).sum()) > 0
    _, frozen = jax.value_and_grad(lambda p: loss_and_metrics(nnx.merge(trainer.graphdef, p), batch, 0.0)[0])(
        trainer.params)
    assert float(jnp.abs(frozen["mtp"]["fc"]["kernel"][...]).sum()) == 0



def test_a_step_that_is_not_finite_is_not_taken():
    """finite_update (the train step's and the RL update's last part): a
    non-finite loss, gradient or update leaves the parameters and optimizer
    state as they were and reports skipped 1.0; a finite one is taken."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from gdnx.training.step import finite_update

    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.full(3, 0.5)}
    cases = [(optax.adam(1.0), 1.0, grads, False), (optax.adam(1.0), float("nan"), grads, True),
             (optax.adam(1.0), 1.0, {"w": jnp.array([0.5, jnp.inf, 0.5])}, True),
             (optax.scale(float("inf")), 1.0, grads, True)]  # a finite gradient, an infinite update
    for tx, loss, g, skipped in cases:
        state = tx.init(params)
        new, new_state, metrics = finite_update(tx, params, state, jnp.float32(loss), g, {})
        assert float(metrics["skipped"]) == float(skipped) and "grad_norm" in metrics
        updates, want_state = tx.update(g, state, params)
        want = (params, state) if skipped else (optax.apply_updates(params, updates), want_state)
        for a, b in zip(jax.tree.leaves((new, new_state)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
