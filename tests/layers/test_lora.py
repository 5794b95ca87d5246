"""LoRA dropout's keys: an adapter's masks are keyed by its module path
(not by how many adapters the process built before it), and each
micro-batch of an accumulated step draws its own."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdnx.config import ModelConfig
from gdnx.data.source import Batch
from gdnx.layers.lora import AdapterSpec, LoRA, dropout_key, fold_dropout
from gdnx.models import CausalLM
from gdnx.training.step import accumulated_gradients

SPEC = AdapterSpec(rank=2, alpha=4.0, dropout=0.5, targets=frozenset({"q_proj", "out_proj"}))
TINY = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, full_attention_interval=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=16, num_experts=0)


def _numbers(model) -> dict[str, int]:
    return {"/".join(map(str, path)): node.number for path, node in nnx.iter_graph(model) if isinstance(node, LoRA)}


def test_an_adapter_is_keyed_by_its_path_whatever_was_built_before():
    first = _numbers(CausalLM(ModelConfig(**TINY), seed=0, adapters=SPEC))
    CausalLM(ModelConfig(**TINY), seed=1, adapters=SPEC)   # more adapters built in this process
    again = _numbers(CausalLM(ModelConfig(**TINY), seed=2, adapters=SPEC))
    assert first == again and len(first) == 2 and len(set(first.values())) == 2


def test_each_micro_batch_draws_its_own_dropout_mask():
    """Two identical micro-batches: the accumulated loss is the sum of the
    two folded keys' losses, which differ (one mask for both would give
    twice one of them)."""
    lora = LoRA(4, 3, SPEC, param_dtype=jnp.float32, rngs=nnx.Rngs(0), path="layer/q_proj")
    lora.lora_b[...] = jnp.ones((2, 3))
    graphdef, params = nnx.split(lora)
    x = jax.random.normal(jax.random.key(1), (1, 8, 4))
    rows = jnp.zeros((2, 8), jnp.int32)
    batch = Batch(rows, rows, jnp.ones((2, 8), bool), jnp.ones((2, 8), bool))
    key = jax.random.key(7)

    def loss(p, data, totals, share):
        value = nnx.merge(graphdef, p)(x).sum() + 0.0 * data.inputs.sum()
        return value, {"loss": value}

    def one(index):
        with dropout_key(key), fold_dropout(index):
            return float(nnx.merge(graphdef, params)(x).sum())

    with dropout_key(key):
        (total, _), _ = jax.jit(lambda p: accumulated_gradients(loss, p, batch, 2))(params)
    first, second = one(0), one(1)
    assert not np.isclose(first, second)
    np.testing.assert_allclose(float(total), first + second, rtol=1e-5)
