"""Sharding on JAX's SPMD: the mesh, logical axis rules, parameter placement,
and the GDN ops under shard_map (tensor and context parallel)."""

from gdnx.parallel.mesh import as_auto, make_mesh, mesh_shape
from gdnx.parallel.params import shard, shardings
from gdnx.parallel.rules import constrain, current_mesh, spec

__all__ = ["as_auto", "constrain", "current_mesh", "make_mesh", "mesh_shape", "shard", "shardings", "spec"]
