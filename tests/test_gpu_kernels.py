"""The pallas_gpu kernels' declared costs per phase (gdnx.gpu_kernels.
declared_costs: traced, no GPU): one gradient step of each op at K=V=128,
bfloat16 inputs, 4,096 tokens. The phases are memory-bound (14-56 FLOPs per
byte where an H100 needs ~300 at its bf16 peak and HBM bandwidth), so the
HBM bytes each moves per token and value head are what is held: within 5%
of today's (the table in docs/benchmarks.md), so a change that moves more
shows here. The registers, spills, grids and tensor-core instructions of
the compiled kernels are checked deviceless in
tests/ops/delta_rule/test_compile.py."""

import jax
import jax.numpy as jnp
import pytest

from gdnx.gpu_kernels import declared_costs
from gdnx.ops import chunk_gated_delta_rule, chunk_kda
from gdnx.ops.delta_rule import GpuTiles

T, HV, D = 4096, 32, 128
# HBM bytes per token and value head, per kernel in launch order (forward, then the backward's)
BYTES = {
    "gdn": [("prepare", 1672), ("state", 2726), ("output", 2056), ("prepare", 1672), ("dv_local", 3592),
            ("dstate", 3112), ("grads", 6930), ("gate_grads", 2840)],
    "kda": [("prepare", 3850), ("state", 3616), ("output", 2560), ("prepare", 4106), ("dv_local", 3584),
            ("dstate", 4384), ("grad_sums", 6152), ("state_grads", 5898), ("pair_grads", 4616)],
}


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_each_phase_moves_no_more_bytes_than_it_does(op):
    hk = 32 if op == "kda" else 16
    sd = jax.ShapeDtypeStruct
    gate = (1, T, HV, D) if op == "kda" else (1, T, HV)
    args = [sd((1, T, hk, D), jnp.bfloat16)] * 2 + [sd((1, T, HV, D), jnp.bfloat16), sd(gate, jnp.float32),
                                                     sd((1, T, HV), jnp.bfloat16)]
    chunk = chunk_kda if op == "kda" else chunk_gated_delta_rule

    def loss(*xs):
        o, _ = chunk(*xs, use_qk_l2norm=True, implementation="pallas_gpu", interpret=False, tiles=GpuTiles())
        return jnp.sum(o.astype(jnp.float32))

    costs = declared_costs(jax.grad(loss, argnums=range(5)), *args)
    assert [c.name for c in costs] == [name for name, _ in BYTES[op]]
    for c, (_, bound) in zip(costs, BYTES[op], strict=True):
        assert c.flops > 0, c
        assert c.bytes_accessed / (T * HV) <= 1.05 * bound, (c, c.bytes_accessed / (T * HV))
