"""Generation on a mesh: the prefill (context-parallel when the mesh has a
context axis, with the GDN states taken from the last shard) gives the
one-device logits and cache (relative error <= 1e-5, float32), and greedy
decoding gives the same tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.config.reading import load_config
from gdnx.generate import generate
from gdnx.models import CausalLM
from gdnx.models.cache import Cache
from gdnx.parallel import shard
from gdnx.measure import relative_error
from tests.parallel.helpers import MESHES, mesh, worst_relative_error
from tests.parallel.helpers import FAMILIES, MODEL

TOL = 1e-5


@functools.cache
def _model(family: str) -> CausalLM:
    return CausalLM(load_config("tiny", MODEL + FAMILIES.get(family, [])).model, seed=0)


# Qwen3-Next on four meshes (the expert axis's: the prefill's and the decode
# steps' token copies exchanged); the other families' own paths (GVA groups
# and q/k norms over tensor shards) on the mesh that splits both tensor and
# context
@pytest.mark.slow
@pytest.mark.parametrize("family, mode, name", [
    ("qwen3_next", "explicit", "context4_tensor2"), ("qwen3_next", "auto", "context8"),
    ("qwen3_next", "auto", "data2_fsdp2_tensor2"), ("qwen3_next", "explicit", "data2_expert2_tensor2"),
    *[(family, "explicit", "context4_tensor2") for family in FAMILIES]])
def test_prefill_and_greedy_decoding_on_a_mesh(family, mode, name):
    model = _model(family)
    prompt = jax.random.randint(jax.random.key(3), (8, 16), 0, model.config.vocab_size, jnp.int32)

    def prefill(m):
        out = m.forward(prompt, Cache.init(m, 8, 24))
        return out.logits, out.cache

    ref_logits, ref_cache = jax.jit(prefill)(model)
    ref_tokens = np.asarray(generate(model, prompt, 6))
    m = mesh(mode, **MESHES[name])
    graphdef, params = nnx.split(model)
    with jax.set_mesh(m):
        sharded = nnx.merge(graphdef, shard(params, model.config, m))
        logits, cache = jax.jit(prefill)(sharded)
        tokens = np.asarray(jax.device_get(generate(sharded, prompt, 6)))
    assert relative_error(logits, ref_logits) <= TOL
    err, where = worst_relative_error(cache, ref_cache)
    assert err <= TOL, f"cache {where}: rel. error {err:.2e}"
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", [("explicit", "context4_tensor2"), ("auto", "data2_fsdp2_tensor2")])
def test_scanned_generation_on_a_mesh_matches_the_unrolled_stack(mode, name):
    """Prefill into the stacked cache and greedy decoding with the scanned
    model on a mesh: the unrolled model's logits (1e-6 relative, float32),
    cache (per layer) and tokens."""
    from tests.parallel.helpers import SCANNED

    prompt = jax.random.randint(jax.random.key(3), (8, 16), 0, 256, jnp.int32)
    m = mesh(mode, **MESHES[name])
    out = {}
    for scan in (False, True):
        model = CausalLM(load_config("tiny", MODEL + SCANNED + [f"model.scan_layers={str(scan).lower()}"]).model,
                         seed=0)
        graphdef, params = nnx.split(model)
        with jax.set_mesh(m):
            sharded = nnx.merge(graphdef, shard(params, model.config, m))
            prefill = jax.jit(lambda s: s.forward(prompt, Cache.init(s, 8, 24)))(sharded)
            tokens = np.asarray(jax.device_get(generate(sharded, prompt, 6)))
        out[scan] = prefill, tokens, model.config
    (ref, ref_tokens, _), (got, tokens, cfg) = out[False], out[True]
    assert relative_error(got.logits, ref.logits) <= 1e-6
    np.testing.assert_array_equal(tokens, ref_tokens)
    # the stacked cache, per layer: cycle position j of repeat r is layer r * cycle + j
    cycle, repeats = cfg.layer_cycle, cfg.cycle_repeats
    for i, layer_cache in enumerate(ref.cache.layers):
        r, j = divmod(i, cycle)
        got_layer = (jax.tree.map(lambda x: x[r], got.cache.layers[j]) if r < repeats
                     else got.cache.layers[cycle + i - repeats * cycle])
        err, where = worst_relative_error(got_layer, layer_cache)
        assert err <= 1e-6, f"layer {i} cache {where}: {err:.2e}"
