"""Weight-only quantization (gdnx.quantization, model.quantize): block
factors with partial edge blocks and one grid per expert; a quantized
checkpoint load equals quantizing the float load whole (the loader reads
whole blocks per part); the quantized model's logits equal transformers'
on the weights it stands for (written dequantized by save_pretrained), and
stay within the quantization's own error of the float model's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import transformers
from flax import nnx

from gdnx import quantization
from gdnx.config import load_config
from gdnx.measure import relative_error, stored_bytes
from gdnx.models import CausalLM
from gdnx.scales import scale_path
from tests.helpers.hf_models import KINDS, hf_logits, tokens

BLOCK = (16, 24)  # rows of the [out, in] matrix, its columns: partial edge blocks on the tiny models


LEVELS = {"int8": 127, "int4": 7}  # the integer kinds' largest step count


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_blocks_partial_edges_and_one_grid_per_expert(kind):
    # three experts, the same values scaled by 1, 2 and 4 (exact in float32)
    w = jax.random.normal(jax.random.key(0), (1, 40, 50)) * jnp.asarray([1.0, 2.0, 4.0])[:, None, None]
    values, scale = quantization.quantize(w, kind, BLOCK)
    assert values.dtype == quantization.DTYPES[kind] and values.shape == w.shape
    assert scale.shape == quantization.grid(w.shape, BLOCK) == (3, 2, 4)
    # each expert its own factors, following its own range
    np.testing.assert_allclose(scale[1] / scale[0], 2, rtol=1e-6)
    np.testing.assert_allclose(scale[2] / scale[0], 4, rtol=1e-6)
    back = quantization.dequantize(values, scale, BLOCK, jnp.float32)
    # int8 / int4: half a step of amax / 127 (7) per block; float8_e4m3fn: 3 mantissa bits, 2^-4 relative
    levels = LEVELS.get(kind, 448)
    bound = 0.5 / levels if kind in LEVELS else 2.0 ** -4
    full = quantization.factors(scale, w.shape, BLOCK) * levels
    err = jnp.abs(back - w) / (full if kind in LEVELS else jnp.maximum(jnp.abs(w), full / 448 * 2.0 ** -6))
    assert float(err.max()) <= bound * 1.01


def test_a_block_side_past_the_weight_is_the_whole_of_it():
    """model.quantize_block=[100000, 100000] (one factor per matrix) and
    [1, 100000] (one per output row) pad and repeat nothing past the weight
    (once a 40 GB padded copy a matrix), and equal blocks of the weight's
    own sides."""
    w = jax.random.normal(jax.random.key(1), (2, 40, 50))
    for huge, own in (((100_000, 100_000), (50, 40)), ((1, 100_000), (1, 40))):
        assert quantization.fitted(w.shape, huge) == own
        values, scale = jax.jit(quantization.quantize, static_argnums=(1, 2))(w, "int8", huge)
        ref_values, ref_scale = quantization.quantize(w, "int8", own)
        assert scale.shape == quantization.grid(w.shape, huge) == ref_scale.shape
        np.testing.assert_array_equal(values, ref_values)
        np.testing.assert_array_equal(scale, ref_scale)
        np.testing.assert_array_equal(quantization.dequantize(values, scale, huge, jnp.float32),
                                      quantization.dequantize(values, scale, own, jnp.float32))
    model = CausalLM(load_config("tiny", ["model.quantize=int8", "model.quantize_block=[100000, 100000]"]).model)
    scales = [s for p, s in nnx.to_flat_state(nnx.state(model)) if str(p[-1]).endswith("_scale")]
    assert scales and all(s.get_value().size == s.get_value().shape[0] if s.get_value().ndim == 3
                          else s.get_value().size == 1 for s in scales)


def test_int4_is_counted_packed_as_xla_stores_it():
    """Memory plans count int4 weights at half a byte (gdnx.measure.stored_bytes),
    what XLA's own memory analysis of a program taking them says."""
    values, _ = quantization.quantize(jnp.ones((3, 40, 50)), "int4", BLOCK)
    held = jax.jit(lambda v: v).lower(values).compile().memory_analysis().argument_size_in_bytes
    assert stored_bytes(values.shape, values.dtype) == held == 3 * 40 * 50 // 2


def test_the_config_names_the_field():
    with pytest.raises(ValueError, match="model.quantize"):
        load_config("tiny", ["model.quantize=int2"])
    with pytest.raises(ValueError, match="model.quantize_block"):
        load_config("tiny", ["model.quantize_block=[0, 128]"])


@pytest.mark.parametrize("kind, family", [("int8", "qwen3_next_moe"), ("int8", "kimi_linear"),
                                          ("fp8", "qwen3_next_moe"), ("fp8", "kimi_linear"),
                                          ("int4", "qwen3_next_moe")])
def test_quantized_load_matches_transformers_on_its_weights(hf_checkpoints, tmp_path, kind, family):
    path = hf_checkpoints.path(family)
    plain = CausalLM.from_pretrained(path)
    model = CausalLM.from_pretrained(path, quantize=kind, quantize_block=BLOCK)
    # the load quantizes block by block what quantizing the float weights whole gives
    got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    scales = 0
    for p, var in nnx.to_flat_state(nnx.state(plain, nnx.Param)):
        if scale_path(p) in got:
            values, scale = quantization.quantize_host(np.asarray(var[...]), kind, BLOCK)
            np.testing.assert_array_equal(np.asarray(got[p][...]).view(np.uint8), np.asarray(values).view(np.uint8))
            np.testing.assert_array_equal(got[scale_path(p)][...], scale)
            scales += 1
        else:
            np.testing.assert_array_equal(got[p][...], var[...])
    assert scales >= 10
    # what it computes: transformers on the dequantized weights (float32 both sides)
    model.save_pretrained(tmp_path / "dequantized")
    hf = getattr(transformers, KINDS[family][1]).from_pretrained(tmp_path / "dequantized").eval()
    toks = tokens(2, 24)
    got_logits = np.asarray(model(toks))
    assert relative_error(got_logits, hf_logits(hf, toks)) <= 1e-5
    # and how far that is from the float model: the quantization's error, not a bug's (int4's step is 18x
    # int8's: 0.07 measured, 0.004 for int8, 0.016 for fp8)
    assert relative_error(got_logits, np.asarray(plain(toks))) <= {"int8": 0.01, "fp8": 0.05, "int4": 0.15}[kind]


def test_experts_in_whole_blocks_reach_the_grouped_matmuls_quantized(hf_checkpoints, tmp_path):
    """Blocks that tile the experts (16 x 16 on the tiny model): the experts
    go to the grouped matmuls quantized (a qwix.QArray; on GPUs tokamax's
    kernel scales its tiles), computing what the dequantized weights do."""
    from gdnx.layers.moe import EXPERT_WEIGHTS, SparseMoE

    model = CausalLM.from_pretrained(hf_checkpoints.path("qwen3_next_moe"), quantize="int8", quantize_block=(16, 16))
    moe = next(m for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoE))
    assert all(isinstance(moe._weights(name, False), qwix.QArray) for name in EXPERT_WEIGHTS)
    model.save_pretrained(tmp_path / "dequantized")
    toks = tokens(2, 24)
    plain = CausalLM.from_pretrained(tmp_path / "dequantized")
    assert relative_error(np.asarray(model(toks)), np.asarray(plain(toks))) <= 1e-6


def test_fp8_activations_products_equal_an_independent_emulation():
    """quantize_activations=fp8: x quantized per token and group of the
    block's 32 columns (factor absmax / 448, values rounded to float8 by
    ml_dtypes here) times the dequantized fp8 weight, in float64, is what
    fp8_product computes (float32 sums: 1e-6)."""
    import ml_dtypes

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (5, 64)) * jnp.linspace(0.1, 3, 64)
    block = (16, 32)
    values, scale = quantization.quantize(jax.random.normal(kw, (64, 48)), "fp8", block)
    got = quantization.fp8_product(x, values, scale, block)
    groups = np.asarray(x, np.float32).reshape(5, 2, 32)
    factor = np.abs(groups).max(-1, keepdims=True) / np.float32(448)
    xq = (groups / factor).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * factor
    w = np.asarray(values).astype(np.float64) * np.repeat(np.repeat(np.asarray(scale, np.float64), 32, 0), 16, 1)
    assert relative_error(got, xq.reshape(5, 64) @ w) <= 1e-6


def test_fp8_activations_in_the_model_and_what_is_refused(hf_checkpoints):
    """A MoE model with fp8 weights and activations (blocks of 16 x 16): the
    matrices they tile (the experts and projections but the 8-wide
    in_proj_ba) take float8 inputs; its logits within float8's rounding of
    the weight-only model's. fp8 activations without fp8 weights are refused
    naming the field."""
    from gdnx.layers.lora import Linear
    from gdnx.layers.moe import SparseMoE

    path = hf_checkpoints.path("qwen3_next_moe")
    weights = CausalLM.from_pretrained(path, quantize="fp8", quantize_block=(16, 16))
    both = CausalLM.from_pretrained(path, quantize="fp8", quantize_block=(16, 16), quantize_activations="fp8")
    modules = [(p[-1], m) for p, m in nnx.iter_modules(both) if isinstance(m, (Linear, SparseMoE))]
    fp8 = {name for name, m in modules if m.activations == "fp8"}
    assert {"experts", "in_proj_qkvz", "o_proj", "out_proj"} <= {"experts" if n == "mlp" else n for n in fp8}
    assert all(m.activations == "none" for name, m in modules if name == "in_proj_ba")
    toks = tokens(2, 24)
    err = relative_error(np.asarray(both(toks)), np.asarray(weights(toks)))
    assert 0 < err <= 0.05
    with pytest.raises(ValueError, match="quantize_activations: fp8 activations multiply fp8 weights"):
        load_config("tiny", ["model.quantize=int8", "model.quantize_activations=fp8"])
