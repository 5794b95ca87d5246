"""The device mesh from the `parallel` config section.

Axes (data, fsdp, expert, tensor, context), in that order so that the axes
that talk most (tensor, context, then the experts' all-to-all) sit on
neighbouring devices. One size may be -1: it
takes the devices the others leave. `shard_mode` picks the axis type: auto
lets XLA place what the model does not pin; explicit carries shardings in
the types and every placement is stated (jax.sharding.reshard).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from gdnx.config.schema import ParallelConfig
from gdnx.parallel.rules import MESH_AXES


def mesh_shape(parallel_cfg: ParallelConfig, num_devices: int) -> tuple[int, ...]:
    sizes = [getattr(parallel_cfg, a) for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ValueError(f"parallel: the fixed axis sizes multiply to {fixed}, which does not divide the "
                              f"{num_devices} devices; the -1 axis cannot take the rest")
        sizes[sizes.index(-1)] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"parallel: data x fsdp x expert x tensor x context = {fixed}, but there are {num_devices} devices; "
                          "make the product equal, or set one axis to -1")
    return tuple(sizes)


def make_mesh(parallel_cfg: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over `devices` (all of jax.devices() when None)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(parallel_cfg, len(devices))
    kind = AxisType.Explicit if parallel_cfg.shard_mode == "explicit" else AxisType.Auto
    return jax.make_mesh(shape, MESH_AXES, axis_types=(kind,) * len(MESH_AXES), devices=devices)


def as_auto(mesh: Mesh) -> Mesh:
    """The same devices and axes, every axis Auto: where a program's layout
    is stated at its edges and XLA places the rest."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
