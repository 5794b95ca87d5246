"""The stacked-layer layout: how a model's parameters hold its layers.

Unrolled, layer i lives under ("layers", i, ...). Scanned
(ModelConfig.scanned), the layers before the stack's repeating cycle are
held under ("head", i, ...); the cycle as one module per position in it
under ("cycle", j, ...), each parameter with a leading dim over the cycle's
repeats (layer i = head + repeat * cycle + j); and the layers after the last
full cycle under ("tail", i, ...). The model
builds this layout; sharding, the optimizer's weight-decay mask and the
Hugging Face mapping read it from here.
"""

from __future__ import annotations

from gdnx.config.schema import ModelConfig

UNROLLED = "layers"
HEAD = "head"
STACKED = "cycle"  # parameters with a leading dim over the cycle's repeats
TAIL = "tail"


def _key_name(k) -> object:
    return getattr(k, "key", getattr(k, "name", None))


def is_stacked(key_path: tuple) -> bool:
    """Whether the parameter at this jax tree key path (into the parameters,
    or a tree holding them such as the optimizer's moments) is stacked."""
    return any(_key_name(k) == STACKED for k in key_path)


def layer_ndim(key_path: tuple, ndim: int) -> int:
    """The rank of one layer's parameter at this key path: a stacked one
    carries one more dim, the repeats."""
    return ndim - 1 if is_stacked(key_path) else ndim


def layer_paths(cfg: ModelConfig, path: tuple) -> tuple[list[tuple], bool]:
    """The unrolled paths ("layers", i, ...) a parameter path of the model
    holds, and whether they are stacked on its leading dim. Any other path
    is its own."""
    if not cfg.scanned or path[0] not in (HEAD, STACKED, TAIL):
        return [path], False
    head, cycle = cfg.layer_head, cfg.layer_cycle
    full = cfg.cycle_repeats * cycle
    if path[0] == HEAD:
        return [(UNROLLED, int(path[1]), *path[2:])], False
    if path[0] == TAIL:
        return [(UNROLLED, head + full + int(path[1]), *path[2:])], False
    return [(UNROLLED, head + r + int(path[1]), *path[2:]) for r in range(0, full, cycle)], True
