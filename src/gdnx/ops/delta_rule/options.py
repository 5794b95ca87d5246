"""The op's vocabulary, with no kernel behind it: implementation names,
chunk sizes, residual policies, and `DeltaRuleOptions`, the settings a
model fixes once, for every delta-rule op. Every default of the ops is
written here. Config and models import this module; the kernels are
imported only by each op's api.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

from jax.typing import DTypeLike

Implementation = Literal["xla", "pallas_tpu", "pallas_gpu", "reference"]
ResidualPolicy = Literal["save", "recompute"]

# the chunked op takes any implementation; the token recurrence is the reference
CHUNK_IMPLEMENTATIONS: tuple[Implementation, ...] = get_args(Implementation)  # KDA's too
RECURRENT_IMPLEMENTATIONS: tuple[Implementation, ...] = ("reference",)
# the Pallas implementations and the platform each is written for
KERNEL_PLATFORMS: dict[Implementation, str] = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}
CHUNK_SIZES = (16, 32, 64, 128)
RESIDUAL_POLICIES: tuple[ResidualPolicy, ...] = get_args(ResidualPolicy)
# checkpoint_name of the residuals the "save" policy keeps, for remat policies
RESIDUAL_NAMES = ("gdn_chunk_states", "gdn_chunk_inverse")


@dataclasses.dataclass(frozen=True)
class DeltaRuleOptions:
    """The settings a model fixes once for every call of the op, with the
    op's defaults: keyword arguments of `chunk_gated_delta_rule` (the
    recurrent op takes the two dtypes). The op checks them at each call."""

    implementation: Implementation | None = None  # None: by platform (dispatch.default_implementation)
    chunk_size: int = 64
    state_dtype: DTypeLike = "float32"
    decay_dtype: DTypeLike = "float32"
    residuals: ResidualPolicy = "save"
    matmul_dtype: DTypeLike | None = None         # None: exact products in state_dtype
    interpret: bool | None = None                 # Pallas only; None: interpret on CPU

    def chunk_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def recurrent_kwargs(self) -> dict[str, Any]:
        return dict(state_dtype=self.state_dtype, decay_dtype=self.decay_dtype)


DEFAULTS = DeltaRuleOptions()
