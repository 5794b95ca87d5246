"""The contract every implementation of the op fills: one `Backend` record.

A chunked backend gives a forward and a backward over chunk blocks
([NC, R, HK, (G,) C, D], gate rows [NC, R, HK, G, 1, C]; packed sequences
already re-laid by the chunk plan; with `token_layout`, q, k, v, a gate
per channel, o and their gradients as token slots [R, NC*C, H, D] instead)
and runs behind the one custom VJP of chunked.py:

    forward(q, k, v, g, beta, h0, flags, *, opts, save_residuals, **knobs)
        -> (o, final[, states, tinv])
    backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, opts, **knobs)
        -> (dq, dk, dv, dg, dbeta, dh0)

where knobs are a kernel's `interpret` and `tiles` (none for XLA). A
backend that is not chunked (the token recurrence) gives the whole op as
`run(q, k, v, g, beta, h0, *, cu_seqlens, scale, state_dtype, decay_dtype)`
and is differentiated by autodiff. Each op's table (its api.IMPLEMENTATIONS)
holds one record per implementation; a new backend is a module that
defines its record (or a function of the Variant that builds it) and one
line there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gdnx.ops.delta_rule.options import RESIDUAL_POLICIES, Implementation, ResidualPolicy
from gdnx.ops.delta_rule.variant import Variant


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
    name: Implementation
    # the chunk algebra a chunked backend runs (variant.py); None: the token
    # recurrence, which runs every variant
    variant: Variant | None = None
    # the platform it is written for ("tpu", "gpu"; None: any, through XLA)
    platform: str | None = None
    forward: Callable | None = None
    backward: Callable | None = None
    run: Callable | None = None
    # what the backward may get from the forward (chunked backends)
    residual_policies: tuple[ResidualPolicy, ...] = RESIDUAL_POLICIES
    # the tiles type a kernel takes (tiles.py); None: no tiles, no interpret mode
    tiles: type | None = None
    # a kernel's limits on the head dims: check_shapes(K, V) raises ValueError
    check_shapes: Callable[[int, int], None] | None = None
    # kernels: a vmap rule folds a mapped axis into their rows (pallas_call's
    # own batching rule adds a grid axis Mosaic's dimension semantics reject)
    fold_batch: bool = False
    # takes q, k, v (a gate per channel) and gives o and their gradients as
    # token slots [R, NC*C, H, D], not chunk blocks (chunked.to_blocks): a
    # kernel whose blocks read the tokens where they lie spares the re-layout
    token_layout: bool = False

    def __post_init__(self):
        if (self.forward is None) != (self.backward is None) or (self.forward is None) == (self.run is None):
            raise ValueError(f"backend {self.name!r}: give forward and backward (chunked) or run, not both")
        if (self.forward is None) != (self.variant is None):
            raise ValueError(f"backend {self.name!r}: a chunked backend names its variant, the recurrence none")

    @property
    def chunked(self) -> bool:
        """Runs behind chunked.run: takes chunk_size, a residual policy and
        matmul_dtype, and applies l2norm itself."""
        return self.forward is not None

    @property
    def kernel(self) -> bool:
        """A Pallas kernel: takes `interpret` and tiles."""
        return self.tiles is not None
