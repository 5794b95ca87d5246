"""Meshes and comparisons shared by the sharding tests."""

import jax

from gdnx.config.schema import ParallelConfig
from gdnx.parallel import make_mesh
from gdnx.measure import relative_error

# the meshes the sharding contract is checked on (8 devices)
MESHES = {
    "data8": dict(data=8),
    "data2_tensor4": dict(data=2, tensor=4),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "context8": dict(data=1, context=8),
    "context4_tensor2": dict(data=1, context=4, tensor=2),
}


def mesh(mode: str, **axes):
    return make_mesh(ParallelConfig(shard_mode=mode, **axes))


def worst_relative_error(tree, ref_tree) -> tuple[float, str]:
    """The largest relative error over matching leaves, and its path."""
    flat = jax.tree_util.tree_flatten_with_path(ref_tree)[0]
    got = jax.tree.leaves(tree)
    errs = [(relative_error(g, r), jax.tree_util.keystr(p)) for (p, r), g in zip(flat, got, strict=True)]
    return max(errs)
