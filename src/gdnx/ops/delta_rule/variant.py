"""What sets one delta-rule op apart from another: a `Variant`.

The gated delta rule (one log decay per value head, g [B, T, HV]) and Kimi
Delta Attention (one per key channel, g [B, T, HV, K]) share everything in
this package: the chunk layout, the custom VJP, the XLA scan over chunks,
the TPU kernels, the token recurrence, the argument checks and the
dispatch. What differs is the gate's shape and the chunk algebra, and that
is what a Variant holds. Each op package defines its own
(`gdnx.ops.gated_delta_rule.math.VARIANT`, `gdnx.ops.kda.math.VARIANT`);
the shared code asks the Variant, never a flag or an array's rank.

The chunk algebra works on one value head's 2-D blocks (primitives.py):

    key_products(q, k, *, matmul_dtype) -> shared
        products a key head's group of value heads shares (GDN: QK^T, KK^T);
        None when every product depends on the value head's gates (KDA)
    key_products_bwd(q, k, *dshared, *, matmul_dtype) -> (dq, dk)
        their adjoint, given the group's summed cotangents
    value_head_forward(q, k, v, g, beta, shared, state, *, scale,
                       decay_dtype, matmul_dtype, looped, inverse=None,
                       split_segments=False)
        -> (o [C, V], outgoing state [K, V], (I + A)^-1 [C, C])
    value_head_backward(q, k, v, g, beta, shared, tinv, state, do,
                        dstate_out, *, scale, decay_dtype, matmul_dtype, looped,
                        split_segments=False)
        -> (grads with dq, dk, dv, dg, dbeta, dstate_in; dshared)

`looped` asks for the forms a kernel compiles quickly (loops that are not
unrolled); the XLA path takes the unrolled ones. `inverse` names the chunk
inverse (primitives.unit_lower_inverse*) in place of the form's own: the
TPU kernels take the one solved by row blocks (`unit_lower_inverse_rows`).
`split_segments` forms the float32 segment sums of the gates as three
exact bfloat16 passes (primitives.segment_sums).

The TPU kernels run these functions under `jax.vmap` over a tile's value
heads, so every product is a batched [heads, C, D] product.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

Gate = Literal["head", "channel"]


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    # the op's family name ("gated_delta_rule", "kda"), for messages
    name: str
    # "head": g [B, T, HV], a scalar decay per value head and token;
    # "channel": g [B, T, HV, K], a diagonal decay over the state's rows
    gate: Gate
    value_head_forward: Callable
    value_head_backward: Callable
    # analytic cost per chunk (costs.py): chunk_flops(C, K, V) -> {part: flops},
    # the parts a value head runs forward and backward, exps per value head chunk
    chunk_flops: Callable[[int, int, int], dict[str, int]]
    forward_parts: tuple[str, ...]
    backward_parts: tuple[str, ...]
    transcendentals: Callable[[int, int], int]
    key_products: Callable | None = None
    key_products_bwd: Callable | None = None

    def __post_init__(self):
        if self.gate not in ("head", "channel"):
            raise ValueError(f"variant {self.name!r}: gate must be 'head' or 'channel', got {self.gate!r}")
        if (self.key_products is None) != (self.key_products_bwd is None):
            raise ValueError(f"variant {self.name!r}: give key_products and key_products_bwd together")

    def gate_layout(self) -> str:
        """The gate's shape as the docs write it."""
        return "[B, T, HV, K]" if self.gate == "channel" else "[B, T, HV]"
