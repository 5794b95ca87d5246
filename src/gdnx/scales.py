"""The name of a quantized weight's block factors: the parameter
`<weight>_scale` beside the weight it scales (`kernel_scale` beside a
quantized Linear's `kernel`, `gate_up_scale` beside the experts'
`gate_up`). Placement, loading, export and the layers make and read the
name here; the factors themselves are gdnx.quantization's."""

from __future__ import annotations

SUFFIX = "_scale"


def scale_name(weight: object) -> str:
    """The factors' name of the weight named `weight`."""
    return f"{weight}{SUFFIX}"


def is_scale(name: object) -> bool:
    """Whether the parameter named `name` holds a weight's block factors."""
    return str(name).endswith(SUFFIX)


def weight_name(name: object) -> str:
    """The weight whose factors are named `name` (`name` itself otherwise)."""
    return str(name).removesuffix(SUFFIX)


def scale_path(path: tuple) -> tuple:
    """The factors' path of the weight at `path` (a parameter path, its last
    part the name)."""
    return (*path[:-1], scale_name(path[-1]))


def weight_path(path: tuple) -> tuple:
    """The weight's path of the factors at `path`."""
    return (*path[:-1], weight_name(path[-1]))
