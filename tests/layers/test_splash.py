"""The splash attention kernel (gdnx.layers.splash, Pallas interpret mode
on CPU) against the plain path (layers.attention.causal_attention): the
attention alone forward and backward, and a model's train-step gradients
with the kernel on and off. Float32 throughout: the two paths differ by
the order of their sums (blocked online softmax against one softmax per
row), so agreement is to float32 rounding, relative 1e-5."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.config import ModelConfig
from gdnx.layers.attention import causal_attention
from gdnx.layers.splash import Splash
from gdnx.measure import relative_error
from gdnx.models import CausalLM

TOL = 1e-5


def _inputs(b=2, t=256, h=4, hkv=2, d=64):
    ks = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[1], (b, t, hkv, d)),
            jax.random.normal(ks[2], (b, t, hkv, d)))


@pytest.mark.parametrize("packed", [False, True])
def test_splash_matches_the_plain_attention_forward_and_backward(packed):
    """Grouped heads (4 query heads over 2 key-value heads), causal, and
    with packed documents (100 + 156 tokens) each query within its own."""
    q, k, v = _inputs()
    t = q.shape[1]
    positions = jnp.arange(t)
    segments = jnp.asarray(np.repeat([[0] * 100 + [1] * (t - 100)], 2, 0), jnp.int32) if packed else None
    kernel = Splash()
    assert kernel.runs(q, k, positions)
    weights = jnp.cos(jnp.arange(q.shape[-1]))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    plain = lambda q, k, v: causal_attention(q, k, v, positions, positions, segments)  # noqa: E731
    fast = lambda q, k, v: kernel(q, k, v, segments)  # noqa: E731
    assert relative_error(jax.jit(fast)(q, k, v), plain(q, k, v)) <= TOL
    ours = jax.jit(jax.grad(loss(fast), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs, strict=True):
        assert relative_error(a, b) <= TOL


def test_splash_takes_only_what_it_can_run():
    """A length off its 128-row tiles, positions per row (a cache's
    offsets) or keys longer than the queries take the plain path."""
    q, k, _ = _inputs(t=128)
    kernel = Splash()
    assert kernel.runs(q, k, jnp.arange(128))
    assert not kernel.runs(q[:, :100], k[:, :100], jnp.arange(100))
    assert not kernel.runs(q, k, jnp.zeros((2, 128), jnp.int32))
    assert not kernel.runs(q, jnp.concatenate([k, k], axis=1), jnp.arange(128))


@pytest.mark.slow
def test_a_train_step_with_the_kernel_matches_the_plain_path():
    """Qwen3.5's pattern (GDN, then gated attention) with its multi-token
    prediction layer, 256 tokens in two packed documents: the loss and every
    gradient with attention_implementation=splash equal those with xla."""
    base = dict(family="qwen3_5", vocab_size=128, hidden_size=64, num_hidden_layers=2, full_attention_interval=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, intermediate_size=128,
                num_experts=0, mtp_num_layers=1)
    tokens = jax.random.randint(jax.random.key(1), (2, 257), 0, 128)
    segments = jnp.asarray(np.repeat([[0] * 90 + [1] * 166], 2, 0), jnp.int32)

    def grads(implementation):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # splash on CPU warns that it interprets
            model = CausalLM(ModelConfig(**base, attention_implementation=implementation), seed=0)

        def loss(m):
            hidden = m.hidden_states(tokens[:, :-1], segments=segments).hidden
            mtp = m.mtp_hidden(hidden, tokens[:, :-1], segments)[0]
            return jnp.mean(m.logits(hidden) ** 2) + jnp.mean(m.logits(mtp) ** 2)

        return nnx.jit(nnx.value_and_grad(loss))(model)

    (l1, g1), (l2, g2) = grads("splash"), grads("xla")
    assert relative_error(l1, l2) <= TOL
    for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2)), strict=True):
        assert relative_error(a, b) <= TOL


def test_a_target_resolves_auto_and_refuses_splash_off_a_tpu():
    """gdnx plan's config for a target: auto takes the compiled kernel on a
    TPU and the plain path on a GPU; splash named for a GPU is refused
    naming the field, never quietly swapped for the plain path."""
    from gdnx.models.causal_lm import for_target

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=16,
                 linear_value_head_dim=16, intermediate_size=64, num_experts=0)
    tpu = for_target(ModelConfig(**small), "tpu")
    assert (tpu.attention_implementation, tpu.attention_interpret) == ("splash", False)
    assert for_target(ModelConfig(**small), "cuda").attention_implementation == "xla"
    with pytest.raises(ValueError, match="model.attention_implementation: splash is a TPU kernel"):
        for_target(ModelConfig(**small, attention_implementation="splash"), "cuda")
