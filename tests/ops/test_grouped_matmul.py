"""Grouped matmuls (gdnx.ops.grouped_matmul) against a dense float64
reference, forward and both gradients: uneven groups, empty groups, one
group taking every row, rows past the groups' total (zeros), and weights
that carry a merged LoRA adapter (the gradient reaches its factors). On
this host the tiled implementation runs; XLA:CPU densifies ragged_dot and
tokamax's kernels refuse to run on a CPU (interpret mode included), so
they are compiled for their targets (the deviceless test at the end) and
checked there for the dense copy they must not make. The choice per platform and every refusal is one line
naming the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.config.reading import load_config
from gdnx.models.causal_lm import check_platform, for_target
from gdnx.ops.grouped_matmul import DEFAULTS, grouped_matmul, resolve, tile_rows

K, N = 24, 40
# group sizes over M = 32 rows: uneven, empty groups, one group with every row, fewer rows than M
SIZES = {"uneven": [5, 11, 3, 13], "empty": [0, 20, 0, 12], "one_takes_all": [0, 0, 32, 0], "short": [3, 0, 9, 4]}


def _reference(x, w, sizes) -> np.ndarray:
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n] @ w[g]
        start += n
    return out


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, K)).astype(np.float32)
    w = rng.standard_normal((4, K, N)).astype(np.float32) / np.sqrt(K)
    dy = rng.standard_normal((32, N)).astype(np.float32)
    return x, w, dy


# float32 products of K = 24 terms against float64: rounding ~ sqrt(K) * 6e-8; 1e-6 leaves a wide margin, and a
# row sent to the wrong group or a missing one is O(1)
TOL = 1e-6


@pytest.mark.parametrize("case", SIZES)
def test_forward_and_gradients_equal_the_dense_reference(case):
    """M = 32 rows over 4 groups: tiles of 8 rows, groups that start and end inside a tile and span several."""
    sizes = SIZES[case]
    x, w, dy = _inputs(0)
    total = sum(sizes)
    assert tile_rows(32, 4) == 8
    y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, jnp.asarray(sizes), implementation="tiled"), x, w)
    dx, dw = vjp(jnp.asarray(dy))
    assert _relative(y, _reference(x, w, sizes)) <= TOL
    assert not np.asarray(y)[total:].any()  # rows past the groups' total are zeros
    # the reference's gradients: dx = dy @ w[g]^T per group's rows; dw[g] = x_g^T dy_g (zero for an empty group)
    want_dx = np.zeros_like(x, np.float64)
    want_dw = np.zeros_like(w, np.float64)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        want_dx[rows] = dy[rows].astype(np.float64) @ w[g].T.astype(np.float64)
        want_dw[g] = x[rows].T.astype(np.float64) @ dy[rows].astype(np.float64)
        start += n
    assert _relative(dx, want_dx) <= TOL
    assert _relative(dw, want_dw) <= TOL
    for g, n in enumerate(sizes):
        if n == 0:
            assert not np.asarray(dw[g]).any()


def test_a_merged_lora_adapter_gets_its_gradient():
    """w = base + a @ b per group (how SparseMoE merges an experts'
    adapter): the factors' gradients equal the dense reference's chain."""
    x, w, dy = _inputs(1)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((4, K, 3)).astype(np.float32) * 0.1
    b = rng.standard_normal((4, 3, N)).astype(np.float32) * 0.1
    sizes = SIZES["uneven"]

    def loss(a, b):
        merged = w + jnp.einsum("gkr,grn->gkn", a, b)
        return jnp.sum(grouped_matmul(jnp.asarray(x), merged, jnp.asarray(sizes), implementation="tiled") * dy)

    da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    dw = np.zeros_like(w, np.float64)
    start = 0
    for g, n in enumerate(sizes):
        dw[g] = x[start:start + n].T.astype(np.float64) @ dy[start:start + n].astype(np.float64)
        start += n
    assert _relative(da, np.einsum("gkn,grn->gkr", dw, b.astype(np.float64))) <= TOL
    assert _relative(db, np.einsum("gkr,gkn->grn", a.astype(np.float64), dw)) <= TOL


def test_each_platform_gets_an_implementation_that_never_densifies():
    assert DEFAULTS == {"cpu": "tiled", "tpu": "xla", "gpu": "triton"}
    assert resolve(None, "cuda") == "triton" and resolve("auto", "tpu") == "xla"
    assert resolve("mosaic", "gpu") == "mosaic"
    with pytest.raises(ValueError, match=r"moe_implementation: xla does not run on gpu: XLA:GPU lowers "
                                         r"jax.lax.ragged_dot to a dense product over every expert; on gpu use tiled "
                                         r"or triton or mosaic \(auto picks triton\)"):
        resolve("xla", "cuda")
    with pytest.raises(ValueError, match=r"moe_implementation: xla does not run on cpu: XLA:CPU lowers"):
        resolve("xla", "cpu")
    with pytest.raises(ValueError, match=r"moe_implementation: triton does not run on tpu; on tpu use tiled or xla "
                                         r"or mosaic"):
        resolve("triton", "tpu")
    with pytest.raises(ValueError, match=r"moe_implementation: no grouped-matmul implementation runs on 'metal'"):
        resolve(None, "metal")
    with pytest.raises(ValueError, match=r"moe_implementation: expected auto or one of \('tiled', 'xla', "
                                         r"'triton', 'mosaic'\), got 'dense'"):
        resolve("dense", "cpu")
    with pytest.raises(ValueError, match=r"implementation: mosaic does not run on cpu"):
        grouped_matmul(jnp.ones((4, K)), jnp.ones((2, K, N)), jnp.asarray([2, 2]), implementation="mosaic")
    with pytest.raises(ValueError, match=r"grouped_matmul: expected x \[M, K\], w \[G, K, N\], group_sizes \[G\]"):
        grouped_matmul(jnp.ones((4, K)), jnp.ones((2, K + 1, N)), jnp.asarray([2, 2]))


def test_the_model_config_names_the_field():
    """model.moe_implementation: checked against its choices on reading, and
    against the platform before a run (and by a plan for its target)."""
    moe = ["model.family=qwen3_next", "model.num_experts=4", "model.num_experts_per_tok=2",
           "model.moe_intermediate_size=16", "model.shared_expert_intermediate_size=16"]
    with pytest.raises(ValueError, match="moe_implementation"):
        load_config("tiny", [*moe, "model.moe_implementation=dense"])
    cfg = load_config("tiny", [*moe, "model.moe_implementation=triton"]).model
    with pytest.raises(ValueError, match="model.moe_implementation: triton does not run on cpu"):
        check_platform(cfg, "cpu")
    auto = load_config("tiny", moe).model
    assert for_target(auto, "cuda").moe_implementation == "triton"
    assert for_target(auto, "tpu").moe_implementation == "xla"
    with pytest.raises(ValueError, match="model.moe_implementation: xla does not run on gpu"):
        for_target(load_config("tiny", [*moe, "model.moe_implementation=xla"]).model, "cuda")


# Qwen3-Next-80B's routed experts on one chip of tensor 2: 4,096 tokens x 10 experts each = 40,960 token copies,
# hidden 2,048, an expert width of 512 / 2, 512 experts, bfloat16. XLA:GPU's dense lowering would hold
# 512 x 40,960 x 2,048 x 2 bytes = 80 GiB; a grouped one holds what the products write (dx [M, K] and dw [G, K, N]:
# 0.5 GiB each in the backward, and XLA:TPU's float32 partials on v5p: 2.5 GiB measured), so 4 GiB is the line.
COPIES, HIDDEN, WIDTH, EXPERTS = 40_960, 2_048, 256, 512
GROUPED_BOUND = 4 * 2 ** 30


@pytest.mark.slow
@pytest.mark.deviceless
@pytest.mark.parametrize("target, implementation", [
    ("tpu_v5e", "xla"), ("tpu_v5e", "mosaic"), ("tpu_v5p", "xla"), ("tpu_v5p", "mosaic"), ("tpu_v6e", "xla"),
    ("tpu_v6e", "mosaic"), ("h100", "triton"), ("h100", "mosaic"), ("a100", "triton")])
def test_the_kernels_compile_forward_and_backward_without_a_dense_copy(target, implementation):
    """Mosaic GPU (Hopper) compiles its forward only here, at 64 experts: its compile time grows with the
    number of groups (on this host, 512 experts: 101 s for the forward alone, 64 experts: 9 s), and its kernel
    holds no dense copy whatever their number."""
    from gdnx import aot

    device = aot.device(target)
    place = jax.sharding.SingleDeviceSharding(device)
    experts = 64 if (target, implementation) == ("h100", "mosaic") else EXPERTS
    args = (jax.ShapeDtypeStruct((COPIES, HIDDEN), jnp.bfloat16, sharding=place),
            jax.ShapeDtypeStruct((experts, HIDDEN, WIDTH), jnp.bfloat16, sharding=place),
            jax.ShapeDtypeStruct((experts,), jnp.int32, sharding=place))

    def forward(x, w, sizes):
        return grouped_matmul(x, w, sizes, implementation=implementation)

    def backward(x, w, sizes):
        return jax.grad(lambda x, w: jnp.sum(forward(x, w, sizes).astype(jnp.float32)), argnums=(0, 1))(x, w)

    programs = (forward,) if (target, implementation) == ("h100", "mosaic") else (forward, backward)
    with aot.targeting(device):
        for program in programs:
            compiled = jax.jit(program).lower(*args).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            assert temp < GROUPED_BOUND, (program.__name__, temp / 2 ** 30)
            text = compiled.as_text()
            if target.startswith("tpu"):
                assert "tpu_custom_call" in text  # XLA's own grouped kernel, or tokamax's
            elif implementation == "triton":
                assert "__gpu$xla.gpu.triton" in text


def test_the_tiled_implementation_holds_no_dense_copy_at_the_80b_shape():
    """Compiled here (not run) at the shape above (XLA:CPU's ragged_dot would hold the 80 GiB dense copy). Tiles
    of 64 rows: 640 tiles + 512 groups = 1,152 pairs, each holding its group's weights and, in the backward,
    their float32 gradient (1,152 x 2,048 x 256 x 6 bytes = 3.4 GiB), so its line is 6 GiB."""
    args = (jax.ShapeDtypeStruct((COPIES, HIDDEN), jnp.bfloat16), jax.ShapeDtypeStruct((EXPERTS, HIDDEN, WIDTH),
            jnp.bfloat16), jax.ShapeDtypeStruct((EXPERTS,), jnp.int32))

    def forward(x, w, sizes):
        return grouped_matmul(x, w, sizes, implementation="tiled")

    def backward(x, w, sizes):
        return jax.grad(lambda x, w: jnp.sum(forward(x, w, sizes).astype(jnp.float32)), argnums=(0, 1))(x, w)

    assert tile_rows(COPIES, EXPERTS) == 64
    for program in (forward, backward):
        temp = jax.jit(program).lower(*args).compile().memory_analysis().temp_size_in_bytes
        assert temp < 6 * 2 ** 30, (program.__name__, temp / 2 ** 30)


def test_quantized_experts_equal_their_dequantized_weights():
    """Experts held quantized (a qwix.QArray: float8 values and a factor per
    16 x 8 block) give what their dequantized weights give, forward and
    gradient of x; the quantized weights get none (frozen)."""
    import qwix

    from gdnx import quantization

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (40, 32), jnp.float32)
    values, scale = quantization.quantize(jax.random.normal(kw, (3, 32, 24)), "fp8", (8, 16))
    w = qwix.QArray(values, scale, qtype=values.dtype)
    plain = quantization.dequantize(values, scale, (8, 16), jnp.float32)
    sizes = jnp.asarray([10, 0, 25], jnp.int32)

    def loss(x, w):
        return jnp.sum(jnp.sin(grouped_matmul(x, w, sizes, implementation="tiled")))

    np.testing.assert_array_equal(grouped_matmul(x, w, sizes, implementation="tiled"),
                                  grouped_matmul(x, plain, sizes, implementation="tiled"))
    np.testing.assert_array_equal(jax.grad(loss)(x, w), jax.grad(loss)(x, plain))


@pytest.mark.slow
@pytest.mark.deviceless
def test_quantized_experts_reach_the_gpu_kernel_as_they_are_held():
    """At the 80B shape above with float8 experts (a factor per 128 x 128
    block), tokamax's Triton kernel takes the float8 values and their
    factors (it scales each tile as it loads it): the forward holds no
    dequantized copy of the experts (512 MiB in bfloat16), and the gradient
    of x compiles (through the dequantized weights: the quantized ones are
    frozen)."""
    import qwix

    from gdnx import aot

    device = aot.device("h100")
    place = jax.sharding.SingleDeviceSharding(device)
    args = (jax.ShapeDtypeStruct((COPIES, HIDDEN), jnp.bfloat16, sharding=place),
            jax.ShapeDtypeStruct((EXPERTS, HIDDEN, WIDTH), jnp.float8_e4m3fn, sharding=place),
            jax.ShapeDtypeStruct((EXPERTS, HIDDEN // 128, WIDTH // 128), jnp.float32, sharding=place),
            jax.ShapeDtypeStruct((EXPERTS,), jnp.int32, sharding=place))

    def forward(x, values, scale, sizes):
        w = qwix.QArray(values, scale, qtype=values.dtype)
        return grouped_matmul(x, w, sizes, implementation="triton")

    def backward(x, values, scale, sizes):
        return jax.grad(lambda x: jnp.sum(forward(x, values, scale, sizes).astype(jnp.float32)))(x)

    dequantized = EXPERTS * HIDDEN * WIDTH * 2
    with aot.targeting(device):
        compiled = jax.jit(forward).lower(*args).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < dequantized / 4
        text = compiled.as_text()
        assert "__gpu$xla.gpu.triton" in text and "f8e4m3fn[512,2048,256]" in text
        assert "bf16[512,2048,256]" not in text
        assert jax.jit(backward).lower(*args).compile().memory_analysis() is not None


@pytest.mark.slow
@pytest.mark.deviceless
def test_fp8_activations_reach_the_gpu_kernel_in_float8():
    """quantize_activations=fp8 (gdnx.quantization.fp8_product) on H100: the
    activations, quantized per token and 128 columns, and the weight's
    float8 blocks both enter tokamax's Triton kernel as float8, whose
    products are on the tensor cores (float16 mma.sync: see
    gdnx.quantization)."""
    import re
    import tempfile
    from pathlib import Path

    from gdnx import aot, quantization

    device = aot.device("h100")
    place = jax.sharding.SingleDeviceSharding(device)
    args = (jax.ShapeDtypeStruct((4096, HIDDEN), jnp.bfloat16, sharding=place),
            jax.ShapeDtypeStruct((HIDDEN, 4096), jnp.float8_e4m3fn, sharding=place),
            jax.ShapeDtypeStruct((HIDDEN // 128, 4096 // 128), jnp.float32, sharding=place))

    def product(x, values, scale):
        return quantization.fp8_product(x, values, scale, (128, 128)).astype(jnp.bfloat16)

    with aot.targeting(device), tempfile.TemporaryDirectory() as dump:
        compiled = jax.jit(product).lower(*args).compile(compiler_options={"xla_dump_to": dump})
        call = next(line for line in compiled.as_text().splitlines() if "__gpu$xla.gpu.triton" in line)
        assert "f8e4m3fn[4096,2048]" in call and "f8e4m3fn[1,2048,4096]" in call, call
        ptx = " ".join(p.read_text() for p in Path(dump).glob("*.ptx"))
        assert re.search(r"\b(?:wgmma\.mma_async|mma\.sync)\S*", ptx)
