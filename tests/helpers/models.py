"""Views of a model's parameters the model tests compare."""

import jax
from flax import nnx

from gdnx.models.causal_lm import CausalLM
from gdnx.stacking import layer_paths


def unrolled_view(model: CausalLM) -> dict[tuple, jax.Array]:
    """A model's parameters by their unrolled paths ("layers", i, ...),
    scanned or not (gdnx.stacking.layer_paths)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        paths, stacked = layer_paths(model.config, path)
        out.update((q, var[i] if stacked else var[...]) for i, q in enumerate(paths))
    return out
