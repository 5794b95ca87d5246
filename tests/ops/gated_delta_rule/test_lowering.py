"""The kernels lower for real hardware from this CPU host, via jax.export.

platforms=["tpu"] runs the Mosaic lowering (block shapes against the (8, 128)
tiling rule, scalar prefetch, the kernel body); platforms=["cuda"] runs the
Triton lowering (power-of-two arrays, every primitive the body uses). The
shape is Qwen3-Next's GDN layer (HK=16, HV=32, K=V=128, T=4096, bfloat16,
B=2), and K=V=64; packed sequences use one row of the same length. The
programs hold exactly the kernels each implementation launches: on TPU one
forward kernel and one backward kernel; on GPU the forward's three phases
(prepare, state, output) and the backward's four (prepare again, dv_local,
dstate, grads).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from gdnx.ops import chunk_gated_delta_rule
from gdnx.ops.delta_rule.triton import TRITON_CUSTOM_CALL_TARGETS

PLATFORMS = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
FORWARD_KERNELS = {"tpu": 1, "cuda": 3}
BACKWARD_KERNELS = {"tpu": 1, "cuda": 5}
DISABLED = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CUSTOM_CALL_TARGETS]


def _shapes(dim, packed):
    b, t, hk, hv = (1 if packed else 2), 4096, 16, 32
    sd = jax.ShapeDtypeStruct
    args = [sd((b, t, hk, dim), jnp.bfloat16), sd((b, t, hk, dim), jnp.bfloat16), sd((b, t, hv, dim), jnp.bfloat16),
            sd((b, t, hv), jnp.float32), sd((b, t, hv), jnp.bfloat16), sd((4 if packed else b, hv, dim, dim), jnp.float32)]
    if packed:
        args.append(sd((5,), jnp.int32))
    return args


def _op(implementation, **kw):
    def f(q, k, v, g, beta, h0, cu=None):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm=True, implementation=implementation, interpret=False, **kw)
    return f


def _kernel_calls(f, platform, args) -> int:
    """How many kernel custom calls the exported program holds."""
    text = export.export(jax.jit(f), platforms=[platform], disabled_checks=DISABLED)(*args).mlir_module()
    if platform == "tpu":
        return text.count("stablehlo.custom_call @tpu_custom_call")
    return sum(text.count(f"stablehlo.custom_call @{t}(") for t in TRITON_CUSTOM_CALL_TARGETS)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_forward_lowers(platform, dim, packed):
    assert _kernel_calls(_op(PLATFORMS[platform]), platform, _shapes(dim, packed)) == FORWARD_KERNELS[platform]


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_grad_lowers(platform, matmul_dtype):
    f = _op(PLATFORMS[platform], matmul_dtype=matmul_dtype)

    def loss(q, k, v, g, beta, h0):
        o, s = f(q, k, v, g, beta, h0)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s * s)

    # the forward kernels (writing residuals) and the backward kernels
    expected = FORWARD_KERNELS[platform] + BACKWARD_KERNELS[platform]
    assert _kernel_calls(jax.grad(loss, argnums=range(6)), platform, _shapes(128, False)) == expected
