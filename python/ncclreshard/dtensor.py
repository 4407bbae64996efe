"""PyTorch DTensor → :class:`Layout`: the mesh's rank table and the placements, as they are."""

from __future__ import annotations

from typing import Any, Optional

from .layout import Layout, RankMap
from .placements import Placement, Replicate, Shard, StridedShard


def _spec_of(value: Any) -> Any:
    spec = getattr(value, "_spec", value)  # a DTensor holds its DTensorSpec as _spec
    if not (hasattr(spec, "mesh") and hasattr(spec, "placements")):
        raise TypeError(
            f"expected a torch DTensor or DTensorSpec, got {type(value).__name__}"
        )
    return spec


def _placement(p: Any, axis: int) -> Placement:
    from torch.distributed.tensor import placement_types as torch_placements

    # _StridedShard subclasses Shard (and compares equal to it): test it first.
    if isinstance(p, torch_placements._StridedShard):
        return StridedShard(int(p.dim), int(p.split_factor))
    if isinstance(p, torch_placements.Shard):
        return Shard(int(p.dim))
    if isinstance(p, torch_placements.Replicate):
        return Replicate()
    if isinstance(p, torch_placements.Partial):
        raise ValueError(
            f"placements[{axis}] is {p!r}: Partial (pending reduction) is not supported; "
            "reduce first, e.g. dtensor.redistribute(placements=[Replicate() or Shard(d), ...])"
        )
    raise ValueError(f"placements[{axis}] is {p!r}, which ncclreshard does not know")


def _mapper(rank_map: Optional[RankMap]) -> Any:
    if rank_map is None:
        return lambda r: r
    if callable(rank_map):
        return rank_map
    if hasattr(rank_map, "keys"):
        return lambda r: rank_map[r]  # type: ignore[index]
    table = list(rank_map)  # type: ignore[arg-type]
    return lambda r: table[r]


def layout_of(value: Any, rank_map: Optional[RankMap]) -> Layout:
    """See :meth:`Layout.from_dtensor`."""
    spec = _spec_of(value)
    mesh = spec.mesh
    torch_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    to_comm = _mapper(rank_map)
    ranks = []
    for r in torch_ranks:
        try:
            ranks.append(int(to_comm(r)))
        except (KeyError, IndexError) as missing:
            raise ValueError(
                f"rank_map has no entry for torch rank {r} of the DTensor's mesh "
                f"{torch_ranks}"
            ) from missing
    places = [_placement(p, i) for i, p in enumerate(spec.placements)]
    return Layout(tuple(mesh.mesh.shape), ranks, places)
