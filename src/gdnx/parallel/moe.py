"""The routed experts under jax.shard_map.

Routing is per token, so each batch / sequence shard routes its own tokens:
no global sort. The tensor axis splits the experts one of two ways
(`split_experts`): each device holds every expert with a slice of its width
(the down projections' partial sums meet in a psum over tensor), or whole
experts, a share of them, and runs the token copies routed to its own (the
tokens are the same on every device of the tensor axis, so the outputs meet
in the same psum). The expert axis (expert parallelism) holds whole
experts, a share per device, and outside the experts is one more data axis:
each device's token copies go to their experts' devices in an all-to-all
and come back in a second one. Where the tokens are too few to be split
over the expert axis (a decode step of one row), they are the same on each
of its devices and meet in a psum as the tensor axis's whole experts do.
The routing counts meet in a psum over the token axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from qwix import QArray

from gdnx.parallel.rules import current_mesh, is_explicit, mesh_axes, spec

TOKENS = ("batch", "length", None)  # x [B, T, hidden], top-k ids / weights [B, T, k]
LANES = 128  # a TPU vector register's lanes: a narrower width slice is padded to it in every copy XLA makes


def split_experts(choice: str, num_experts: int, expert_size: int, mesh: Mesh | AbstractMesh | None = None,
                  ) -> bool:
    """Whether the tensor axis of `mesh` (the ambient one by default) splits
    the routed experts by expert rather than by width. choice: the config's
    moe_split (auto, width or experts). An expert axis that does not divide
    the experts, or experts on a tensor axis that does not divide each
    expert axis shard's share, is a ValueError naming both numbers."""
    mesh = mesh or current_mesh()
    sizes = dict(mesh.shape) if mesh is not None else {}
    tensor, expert = sizes.get("tensor", 1), sizes.get("expert", 1)
    if num_experts % expert:
        raise ValueError(f"parallel.expert: the expert axis ({expert}) must divide model.num_experts ({num_experts})")
    share = num_experts // expert
    if tensor == 1 or choice == "width":
        return False
    if choice == "experts":
        if share % tensor:
            raise ValueError(f"model.moe_split: experts needs the tensor axis ({tensor}) to divide num_experts "
                             f"({num_experts})" + (f" / expert ({expert}) = {share}" if expert > 1 else ""))
        return True
    return share % tensor == 0 and (expert_size % tensor != 0 or (expert_size // tensor) % LANES != 0)


def expert_axes(split: bool) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """The logical axes of the experts' gate/up [E, hidden, width] and down
    [E, width, hidden] weights: whole experts over the expert axis, and the
    tensor axis on their width or (split) on whole experts too."""
    if split:
        return ("experts", "embed", None), ("experts", None, "embed")
    return ("routed", "embed", "mlp"), ("routed", "mlp", "embed")


class ShardAxes(NamedTuple):
    """The mesh axes a shard of the routed experts works over (all empty
    without a mesh). sums: those to psum the partial outputs over; experts:
    those whose devices hold a share of the experts each and see the same
    tokens (the shard holds experts [i E/n, (i+1) E/n) of what reaches it);
    tokens: those to psum the routing counts over; dispatch: the expert
    axis when the tokens are split over it, whose devices exchange token
    copies in an all-to-all (None otherwise)."""
    sums: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()
    dispatch: str | None = None


def holds_whole_blocks(shape: tuple[int, ...], split: bool) -> bool:
    """Whether each shard of an experts' weight of `shape` holds whole
    matrices (no mesh, or a mesh that splits the experts alone), so that
    quantized weights can reach the grouped matmuls with their factors
    as they are."""
    mesh = current_mesh()
    if mesh is None:
        return True
    gate_up_axes, _ = _product_axes(split)
    return all(a is None for a in spec(gate_up_axes, shape, mesh=mesh)[1:])


def _product_axes(split: bool) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """expert_axes without their fsdp split: the weights as the products take
    them (gathered over fsdp)."""
    gate_up, down = expert_axes(split)
    return tuple(None if a == "embed" else a for a in gate_up), tuple(None if a == "embed" else a for a in down)


def _weight_spec(w, weight_spec: P):
    """A weight's in_spec: a quantized one (qwix.QArray, whole matrices a
    shard) its values' and its factors' split alike over the experts."""
    if isinstance(w, QArray):
        return dataclasses.replace(w, qvalue=weight_spec, scale=P(weight_spec[0], None, None))
    return weight_spec


def run_experts(local: Callable, x: jax.Array, top_p: jax.Array, top_i: jax.Array, w_gate: jax.Array | QArray,
                w_up: jax.Array | QArray, w_down: jax.Array | QArray, *, split: bool = False,
                kernels: bool = False) -> jax.Array:
    """local(x, top_p, top_i, w_gate, w_up, w_down, axes: ShardAxes) -> (y
    [B, T, hidden], counts [E]) on each shard. split: whole experts over
    tensor (split_experts). The weights may be quantized (qwix.QArray)
    where each shard holds whole matrices (holds_whole_blocks). kernels:
    local runs Pallas kernels, whose outputs carry no varying-axes
    information (the shard_map then checks none)."""
    mesh = current_mesh()
    if mesh is None:
        return local(x, top_p, top_i, w_gate, w_up, w_down, ShardAxes())
    tok = spec(TOKENS, x.shape, mesh=mesh)
    # the weights without their fsdp split (gathered for the products)
    gate_up_axes, down_axes = _product_axes(split)
    gate_up, down = spec(gate_up_axes, w_gate.shape, mesh=mesh), spec(down_axes, w_down.shape, mesh=mesh)
    weights = (w_gate, w_up, w_down)
    specs = (tok, P(*tok[:2], None), P(*tok[:2], None), *(_weight_spec(w, s) for w, s in
                                                           zip(weights, (gate_up, gate_up, down))))
    args = (x, top_p, top_i, *weights)
    if is_explicit(mesh):
        args = tuple(jax.tree.map(jax.sharding.reshard, a, s) for a, s in zip(args, specs, strict=True))
    experts, token_axes = mesh_axes(gate_up[0]), mesh_axes(*tok[:2])
    dispatch = "expert" if "expert" in experts and "expert" in token_axes else None
    experts = tuple(a for a in experts if a != dispatch)
    axes = ShardAxes(experts + mesh_axes(gate_up[2]), experts, token_axes, dispatch)

    def body(*xs):
        return local(*xs, axes)

    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=not kernels)(*args)


# where XLA implements ragged_all_to_all (XLA:CPU does not): each device's copies travel as they are, not padded
# to the worst case
RAGGED_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")


class Exchange(NamedTuple):
    """How one device's token copies, sorted by the device they go to, travel
    over the dispatch axis and back. Each device receives every other's
    copies into a block of its own, `block` rows from source i's at i *
    block (block: the most copies one device can send another), so the
    received rows are [n * block] and padding is whatever the sender did not
    fill. ragged: ragged_all_to_all sends the copies alone; otherwise an
    all_to_all sends each block whole (n times the rows, on average)."""
    axis: str
    sent: jax.Array    # int32 [n]: the copies this device sends each device
    starts: jax.Array  # int32 [n]: where each device's copies start among this device's sorted copies
    block: int
    ragged: bool

    @classmethod
    def plan(cls, dest: jax.Array, axis: str, block: int, ragged: bool) -> Exchange:
        """dest: int32 [C], the sorted copies' devices (ascending)."""
        sent = jnp.bincount(dest, length=jax.lax.axis_size(axis)).astype(jnp.int32)
        return cls(axis, sent, jnp.cumsum(sent) - sent, block, ragged)

    def send(self, copies: jax.Array, fill: int | float = 0) -> jax.Array:
        """copies [C, ...] sorted by device -> the rows received [n * block,
        ...] (fill where no copy landed)."""
        n = jax.lax.axis_size(self.axis)
        out = jnp.full((n * self.block, *copies.shape[1:]), fill, copies.dtype)
        if self.ragged:
            me = jax.lax.axis_index(self.axis).astype(jnp.int32)
            return jax.lax.ragged_all_to_all(copies, out, self.starts, self.sent, jnp.full((n,), me * self.block),
                                             self._received(), axis_name=self.axis)
        dest, slot = self._places(copies.shape[0])
        blocks = out.reshape(n, self.block, *copies.shape[1:]).at[dest, slot].set(copies)
        return jax.lax.all_to_all(blocks, self.axis, 0, 0).reshape(out.shape)

    def back(self, rows: jax.Array, count: int) -> jax.Array:
        """The received rows' results [n * block, ...] returned to their
        senders: [count, ...] in the order they were sent."""
        n = jax.lax.axis_size(self.axis)
        if self.ragged:
            received = self._received()
            starts = jax.lax.all_to_all(self.starts, self.axis, 0, 0, tiled=True)  # mine on each source device
            out = jnp.zeros((count, *rows.shape[1:]), rows.dtype)
            return jax.lax.ragged_all_to_all(rows, out, jnp.arange(n, dtype=jnp.int32) * self.block, received,
                                             starts, self.sent, axis_name=self.axis)
        blocks = jax.lax.all_to_all(rows.reshape(n, self.block, *rows.shape[1:]), self.axis, 0, 0)
        return blocks[self._places(count)]

    def _received(self) -> jax.Array:
        return jax.lax.all_to_all(self.sent, self.axis, 0, 0, tiled=True)

    def _places(self, count: int) -> tuple[jax.Array, jax.Array]:
        """Each sorted copy's (device, row within the block it goes in)."""
        n = jax.lax.axis_size(self.axis)
        dest = jnp.repeat(jnp.arange(n, dtype=jnp.int32), self.sent, total_repeat_length=count)
        return dest, jnp.arange(count, dtype=jnp.int32) - self.starts[dest]
