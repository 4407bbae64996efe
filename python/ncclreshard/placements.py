"""Placements along one mesh axis, as in PyTorch DTensor: ``Replicate``, ``Shard(dim)`` and
``StridedShard(dim, split_factor)`` (torch's ``_StridedShard``), plus ``ShardBlocks(dim, block)``,
which torch lacks (vLLM's and Megatron's vocab-parallel embeddings). ``Partial`` is not
supported: reduce the tensor first."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from . import _lib


def _index(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} is {value}; it must be at least {minimum}")
    return value


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the whole (current) tensor."""

    def __str__(self) -> str:
        return "Replicate"


@dataclass(frozen=True)
class Shard:
    """The axis cuts tensor dim ``dim`` with torch.chunk's rule (remainders to the front)."""

    dim: int

    def __post_init__(self) -> None:
        _index(self.dim, "Shard.dim", 0)

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class StridedShard:
    """torch ``_StridedShard(dim, split_factor)``: FSDP2 + TP's right-to-left sharding; dim
    ``dim`` is split into ``split_factor`` pieces and the axis takes its chunk of each."""

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        _index(self.dim, "StridedShard.dim", 0)
        _index(self.split_factor, "StridedShard.split_factor", 1)

    def __str__(self) -> str:
        return f"StridedShard({self.dim},{self.split_factor})"


@dataclass(frozen=True)
class ShardBlocks:
    """Not a torch placement: the axis cuts tensor dim ``dim`` into blocks of ``block`` indices;
    coordinate c holds ``[c*block, (c+1)*block)`` of the current list, clipped to it (trailing
    coordinates short or empty). vLLM's vocab-parallel embedding and LM head hold rows so:
    blocks of ``Vp // tp`` rows of the vocabulary padded to ``Vp``, where torch.chunk would cut
    elsewhere."""

    dim: int
    block: int

    def __post_init__(self) -> None:
        _index(self.dim, "ShardBlocks.dim", 0)
        _index(self.block, "ShardBlocks.block", 1)

    def __str__(self) -> str:
        return f"ShardBlocks({self.dim},{self.block})"


Placement = Union[Replicate, Shard, StridedShard, ShardBlocks]

_KINDS = {Replicate: 0, Shard: 1, StridedShard: 2, ShardBlocks: 3}
_ARGS = re.compile(r"^\s*(?:\w+\s*=\s*)?(\d+)\s*$")


def parse(text: str, what: str = "placement") -> Placement:
    """A placement from the case-file text: ``Replicate`` (``R``), ``Shard(d)`` (``S(d)``),
    ``StridedShard(d,split_factor)`` (``_StridedShard(dim=d, split_factor=s)``),
    ``ShardBlocks(d,block)``.

    Raises TypeError for a non-string, ValueError for other text (Partial included).
    """
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected a string, got {type(text).__name__}")
    compact = text.strip()
    if compact in ("Replicate", "Replicate()", "R"):
        return Replicate()
    if compact.startswith("Partial") or compact == "P":
        raise ValueError(
            f"{what} {text!r}: Partial is not supported; reduce the tensor before resharding"
        )
    match = re.fullmatch(r"(\w+)\((.*)\)", compact)
    if match:
        name, args = match.group(1), match.group(2).split(",")
        values = [_ARGS.match(a) for a in args]
        if all(values):
            numbers = [int(v.group(1)) for v in values if v]
            if name in ("Shard", "S") and len(numbers) == 1:
                return Shard(numbers[0])
            if name in ("StridedShard", "_StridedShard", "_S") and len(numbers) == 2:
                return StridedShard(numbers[0], numbers[1])
            if name == "ShardBlocks" and len(numbers) == 2:
                return ShardBlocks(numbers[0], numbers[1])
    raise ValueError(
        f"{what} {text!r} is not one of Replicate, Shard(d), StridedShard(d,split_factor), "
        "ShardBlocks(d,block)"
    )


def to_c(placement: Placement, what: str) -> _lib.Placement_t:
    """The C struct of a placement; TypeError for anything that is not one."""
    kind = _KINDS.get(type(placement))
    if kind is None:
        raise TypeError(
            f"{what}: expected Replicate(), Shard(dim), StridedShard(dim, split_factor) or "
            f"ShardBlocks(dim, block), got {placement!r}"
        )
    dim = getattr(placement, "dim", 0)
    split = getattr(placement, "split_factor", getattr(placement, "block", 0))
    return _lib.Placement_t(kind, dim, split)
