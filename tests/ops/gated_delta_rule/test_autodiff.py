"""How the op behaves under JAX transformations: jit, grad, vmap of grad,
remat with the named residuals, and forward mode (unsupported)."""

import jax
import jax.numpy as jnp
import pytest

from gdnx.ops import chunk_gated_delta_rule
from tests.ops.delta_rule.cases import Case, make_inputs
from gdnx.measure import relative_error

HAND_WRITTEN = ["xla", "pallas_tpu", "pallas_gpu"]
CASE = Case("ad", b=2, t=20, dk=16, dv=16, chunk=16, l2norm=True)


def loss_fn(implementation, **kw):
    def loss(q, k, v, g, beta, h0):
        o, f = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16,
                                      use_qk_l2norm=True, implementation=implementation, **kw)
        return jnp.sum(jnp.sin(o)) + jnp.sum(f * f)
    return loss


@pytest.mark.parametrize("implementation", HAND_WRITTEN)
def test_vmap_of_grad(implementation):
    """vmap over a leading axis of grad equals grad per example."""
    q, k, v, g, beta, h0 = make_inputs(CASE)
    grad = jax.grad(loss_fn(implementation), argnums=(0, 2, 3, 5))
    # two "examples": the batch rows, each a batch of one
    rows = [tuple(x[i:i + 1] for x in (q, k, v, g, beta, h0)) for i in range(2)]
    stacked = tuple(jnp.stack(xs) for xs in zip(*rows))
    batched = jax.jit(jax.vmap(grad))(*stacked)
    for i, row in enumerate(rows):
        for got, want in zip(batched, grad(*row)):
            assert relative_error(got[i], want) < 1e-6


@pytest.mark.parametrize("implementation", HAND_WRITTEN)
def test_forward_mode_is_refused(implementation):
    args = make_inputs(CASE)
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(loss_fn(implementation), args, tuple(jnp.zeros_like(x) for x in args))


@pytest.mark.parametrize("implementation", HAND_WRITTEN)
def test_residual_names(implementation):
    """'save' tags the residuals by name, 'recompute' has none to tag."""
    args = make_inputs(CASE)
    for residuals, present in (("save", True), ("recompute", False)):
        text = str(jax.make_jaxpr(jax.grad(loss_fn(implementation, residuals=residuals)))(*args))
        assert ("gdn_chunk_states" in text) == present
        assert ("gdn_chunk_inverse" in text) == present


@pytest.mark.parametrize("policy", ["save_states", "save_nothing"])
def test_remat_policy_by_name(policy):
    """Under jax.checkpoint with a names policy the gradients stay right."""
    args = make_inputs(CASE)
    names = ("gdn_chunk_states", "gdn_chunk_inverse") if policy == "save_states" else ()
    remat = jax.checkpoint(loss_fn("xla"), policy=jax.checkpoint_policies.save_only_these_names(*names))
    want = jax.grad(loss_fn("xla"), argnums=range(6))(*args)
    got = jax.jit(jax.grad(remat, argnums=range(6)))(*args)
    for x, y in zip(got, want):
        assert relative_error(x, y) < 1e-6
