"""What every rank of a trainer→vLLM refit plans from, and the one function that turns it into
the plan's specs.

Trainer ranks declare, per checkpoint tensor (Hugging Face name), its global shape, dtype and
source :class:`~ncclreshard.Layout` (:class:`SourceTensor`). vLLM workers declare, per
checkpoint tensor they hold part of, the box of the global tensor their live parameter holds
and where in the parameter it lies (:class:`DestinationPiece`, derived from the live model by
:mod:`ncclreshard.vllm.layouts`). Every rank publishes its declarations, reads everyone's, and
calls :func:`build` on the same list, so every rank makes the same specs — or raises the same
error, naming the tensor and the vLLM parameter, before anything is sent.

The destination layout of a tensor is inferred from the workers' boxes (distinct intervals
along each dim are the shards; workers with the same box are replicas) and then checked box by
box against what the library says each rank holds under it (:func:`~ncclreshard.local_runs`):
vLLM's placements that DTensor can state come out as ``Shard``, the vocabulary's fixed blocks
as ``ShardBlocks``, and anything else is refused as a layout the library cannot express.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import dtypes
from ..layout import Layout, local_runs
from ..placements import Placement, Replicate, Shard, ShardBlocks
from ..spec import Quant, TensorSpec

Box = Tuple[Tuple[int, int], ...]

# The block scales of an FP8 weight `<name>` are `<name>_scale_inv` (vLLM's `weight_scale_inv`,
# `w13_weight_scale_inv`, `w2_weight_scale_inv`; DeepSeek-V3's checkpoint names).
SCALE_SUFFIX = "_scale_inv"


class RefitError(ValueError):
    """A refit that cannot be planned: a tensor the model does not have, a vLLM parameter no
    trainer sends, a shape, dtype or layout that does not fit. The message names the
    checkpoint tensor and the vLLM parameter; every rank raises the same one."""


@dataclass(frozen=True)
class SourceTensor:
    """One checkpoint tensor as the trainer holds it: its Hugging Face `name`, global `shape`
    and `dtype`, and its `layout` over trainer ranks of the refit group (strides when the
    ranks' views are strided). `shape` may split dim 0 of the checkpoint's shape in two
    (``[groups, rows_per_group, …]``), as interleaved Megatron ``linear_qkv`` views need."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    layout: Layout

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtypes.name(self.dtype),
                "layout": self.layout.to_json()}

    @classmethod
    def from_json(cls, value: Mapping[str, Any], layout: Optional[Layout] = None) -> "SourceTensor":
        """The tensor of `value`; `layout`, when given, stands for its "layout" entry (a
        declaration lists its layouts once, its tensors refer to them by index)."""
        if layout is None:
            layout = Layout.from_json(value["layout"], f"{value['name']}.layout")
        return cls(value["name"], tuple(value["shape"]), dtypes.to_dtype(value["dtype"]), layout)


@dataclass(frozen=True)
class DestinationPiece:
    """What one vLLM worker holds of one checkpoint tensor: the checkpoint `name`, the
    checkpoint `shape` vLLM's loader expects, the vLLM parameter `param` (its `dtype`) it
    lands in, the `box` of the global tensor held (``[start, stop)`` per dim, in the
    checkpoint's coordinates) and the element `offset` in the (contiguous) parameter where that
    box starts; the box's elements lie there back to back in row-major order."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    param: str
    box: Box
    offset: int
    # An FP8 block-quantized weight: its block (rows, cols); its scale's pieces name it in
    # `scale_of` (their `name` is the weight's plus SCALE_SUFFIX, `shape` the block grid).
    block: Optional[Tuple[int, int]] = None
    scale_of: Optional[str] = None

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)

    def to_json(self) -> Dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": dtypes.name(self.dtype),
               "param": self.param, "box": [list(b) for b in self.box], "offset": self.offset}
        if self.block is not None:
            out["block"] = list(self.block)
        if self.scale_of is not None:
            out["scale_of"] = self.scale_of
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "DestinationPiece":
        block = value.get("block")
        return cls(value["name"], tuple(value["shape"]), dtypes.to_dtype(value["dtype"]),
                   value["param"], tuple((int(a), int(b)) for a, b in value["box"]),
                   int(value["offset"]), tuple(int(b) for b in block) if block else None,
                   value.get("scale_of"))


@dataclass(frozen=True)
class Declaration:
    """One rank's declaration: trainers list `sources`, workers `pieces`; `error` is the
    rank's own failure to declare (every rank then raises it)."""

    rank: int
    role: str  # "trainer" or "worker"
    sources: Tuple[SourceTensor, ...] = ()
    pieces: Tuple[DestinationPiece, ...] = ()
    error: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        """JSON with each distinct source layout once (``layouts``) and the tensors referring
        to them by index: a model's thousands of tensors share a handful of layouts."""
        layouts: List[Layout] = []
        index: Dict[Layout, int] = {}
        sources = []
        for s in self.sources:
            if s.layout not in index:
                index[s.layout] = len(layouts)
                layouts.append(s.layout)
            sources.append({"name": s.name, "shape": list(s.shape), "dtype": dtypes.name(s.dtype),
                            "layout": index[s.layout]})
        return {"rank": self.rank, "role": self.role, "layouts": [l.to_json() for l in layouts],
                "sources": sources, "pieces": [p.to_json() for p in self.pieces], "error": self.error}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> "Declaration":
        layouts = [Layout.from_json(l, f"rank {value['rank']}: layouts[{i}]")
                   for i, l in enumerate(value["layouts"])]
        return cls(int(value["rank"]), value["role"],
                   tuple(SourceTensor.from_json(s, layouts[s["layout"]]) for s in value["sources"]),
                   tuple(DestinationPiece.from_json(p) for p in value["pieces"]),
                   value.get("error"))


@dataclass(frozen=True)
class Refit:
    """The specs every rank plans from, in one order, and where each lands on the workers:
    ``pieces[i][rank]`` is worker `rank`'s piece of ``specs[i]`` (absent: it holds none) and,
    for a quantized spec, ``scales[i][rank]`` its piece of the block scales (empty dicts for
    the others)."""

    specs: Tuple[TensorSpec, ...]
    pieces: Tuple[Dict[int, DestinationPiece], ...]
    scales: Tuple[Dict[int, DestinationPiece], ...] = ()

    def __post_init__(self) -> None:
        if not self.scales:
            object.__setattr__(self, "scales", tuple({} for _ in self.specs))

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name or "" for s in self.specs)

    def subset(self, names: Optional[Sequence[str]]) -> "Refit":
        """The tensors `names` (None: all), in this refit's order; RefitError for a name it
        does not have."""
        if names is None:
            return self
        wanted = list(names)
        index = {n: i for i, n in enumerate(self.names)}
        unknown = [n for n in wanted if n not in index]
        if unknown:
            raise RefitError(
                f"{unknown[0]!r} is not among the tensors declared for this refit "
                f"({len(index)} tensors); declare it (a new epoch) before sending it"
            )
        if len(set(wanted)) != len(wanted):
            twice = next(n for n in wanted if wanted.count(n) > 1)
            raise RefitError(f"{twice!r} is named twice in one update")
        keep = sorted(index[n] for n in wanted)
        return Refit(tuple(self.specs[i] for i in keep), tuple(self.pieces[i] for i in keep),
                     tuple(self.scales[i] for i in keep))


def _split_box(box: Box, shape: Sequence[int], groups: int, rows: int, rank: int, name: str, param: str) -> Box:
    """`box` of the checkpoint's ``[groups·rows, …]`` in the trainer's ``[groups, rows, …]``."""
    a, b = box[0]
    if b == a:
        first = ((0, 0), (0, rows))
    elif a % rows == 0 and b % rows == 0:
        first = ((a // rows, b // rows), (0, rows))
    elif a // rows == (b - 1) // rows:
        first = ((a // rows, a // rows + 1), (a % rows, a % rows + b - a))
    else:
        raise RefitError(
            f"{name}: the trainer declares it as {list(shape)}, groups of {rows} rows, but "
            f"vLLM's {param} on rank {rank} holds rows [{a}, {b}), which cut a group"
        )
    return first + tuple(box[1:])


def _placement_candidates(dim: int, size: int, intervals: List[Tuple[int, int]]) -> List[Placement]:
    """Placements that may cut dim `dim` into these intervals (the library decides)."""
    out: List[Placement] = [Shard(dim)]
    block = intervals[0][1] - intervals[0][0]
    if block > 0 and block * len(intervals) >= size:
        out.append(ShardBlocks(dim, block))
    return out


def _held(layout: Layout, shape: Sequence[int], rank: int) -> Box:
    """The box `rank` holds under `layout` (each dim's runs must form one interval)."""
    out = []
    for runs in local_runs(layout, shape, rank):
        runs = [(a, b) for a, b in runs if b > a]
        if not runs:
            out.append((0, 0))
            continue
        for (_, end), (start, _) in zip(runs, runs[1:]):
            if start != end:
                return ()
        out.append((runs[0][0], runs[-1][1]))
    return tuple(out)


def _same(held: Box, box: Box) -> bool:
    if len(held) != len(box):
        return False
    for (a, b), (c, d) in zip(held, box):
        if b - a != d - c or (b > a and a != c):
            return False
    return True


def layout_from_boxes(name: str, shape: Sequence[int], holders: Mapping[int, Box]) -> Layout:
    """The destination layout under which each rank of `holders` holds exactly its box of a
    tensor of `shape`: a mesh axis per sharded dim (its distinct intervals in order) plus one
    of replicas when several ranks hold the same box. RefitError when no layout the library
    knows gives every rank its box."""
    ranks = sorted(holders)
    sharded: List[Tuple[int, List[Tuple[int, int]]]] = []
    for d, size in enumerate(shape):
        intervals = sorted({holders[r][d] for r in ranks}, key=lambda iv: (iv[0], iv[1] - iv[0] == 0, iv[1]))
        if intervals != [(0, size)]:
            sharded.append((d, intervals))
    coordinate = {
        r: tuple(intervals.index(holders[r][d]) for d, intervals in sharded) for r in ranks
    }
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for r in ranks:
        groups.setdefault(coordinate[r], []).append(r)
    counts = [len(iv) for _, iv in sharded]
    replicas = {len(g) for g in groups.values()}
    cells = math.prod(counts)
    if len(groups) != cells or len(replicas) != 1:
        raise RefitError(
            f"{name}: vLLM's workers hold boxes {[list(map(list, holders[r])) for r in ranks]} of "
            f"{list(shape)}, which no mesh of shards and replicas gives every worker (a layout "
            "the library cannot express)"
        )
    copies = replicas.pop()
    mesh = counts + ([copies] if copies > 1 or not counts else [])
    table = [r for cell in itertools.product(*(range(c) for c in counts)) for r in groups[cell]]
    tail: List[Placement] = [Replicate()] if copies > 1 or not counts else []
    options = [_placement_candidates(d, shape[d], iv) for d, iv in sharded]
    for choice in itertools.product(*options):
        layout = Layout(mesh, table, list(choice) + tail)
        if all(_same(_held(layout, shape, r), holders[r]) for r in ranks):
            return layout
    raise RefitError(
        f"{name}: vLLM's workers hold boxes {[list(map(list, holders[r])) for r in ranks]} of "
        f"{list(shape)}, which neither Shard nor ShardBlocks gives them (a layout the library "
        "cannot express)"
    )


def _merge_sources(name: str, found: Sequence[Tuple[int, SourceTensor]]) -> SourceTensor:
    """One source from every trainer rank's declaration of `name`. Ranks that declare the same
    layout agree; ranks that declare the same layout on disjoint rank tables hold replicas
    (FSDP2 + TP: a parameter TP leaves whole is a DTensor on each TP rank's own data-parallel
    mesh), stacked on a new outer ``Replicate`` axis in the order of their first ranks."""
    distinct: List[SourceTensor] = []
    for _, s in found:
        if s not in distinct:
            distinct.append(s)
    if len(distinct) == 1:
        return distinct[0]
    first = distinct[0]
    shapes = {(s.shape, s.dtype, s.layout.mesh_shape, s.layout.placements, s.layout.strides) for s in distinct}
    tables = [s.layout.ranks for s in distinct]
    flat = [r for t in tables for r in t]
    if len(shapes) != 1 or len(set(flat)) != len(flat) or None in flat:
        detail = "; ".join(f"rank {r}: {s.to_json()}" for r, s in found if s is not first)
        raise RefitError(
            f"{name}: trainer ranks declare it differently ({first.to_json()}; {detail}); "
            "every trainer rank must declare the same tensor, or replicas of one layout on "
            "disjoint ranks"
        )
    tables.sort(key=lambda t: min(r for r in t if r is not None))
    layout = Layout((len(tables),) + first.layout.mesh_shape, [r for t in tables for r in t],
                    (Replicate(),) + first.layout.placements, first.layout.strides)
    return SourceTensor(name, first.shape, first.dtype, layout)


def build(declarations: Sequence[Declaration]) -> Refit:
    """The refit's specs from every rank's declaration (the same list on every rank gives the
    same specs there). Raises RefitError naming the tensor and the vLLM parameter for: a rank
    that could not declare; a tensor two trainers declare differently (but as replicas, see
    :func:`_merge_sources`); a checkpoint tensor no
    trainer sends (naming the vLLM parameter waiting for it); one the model does not have; a
    shape or dtype that differs from the vLLM parameter's; boxes no layout gives."""
    for d in sorted(declarations, key=lambda d: d.rank):
        if d.error is not None:
            raise RefitError(f"rank {d.rank} ({d.role}): {d.error}")
    declared: Dict[str, List[Tuple[int, SourceTensor]]] = {}
    for d in sorted(declarations, key=lambda d: d.rank):
        for s in d.sources:
            declared.setdefault(s.name, []).append((d.rank, s))
    sources = {name: _merge_sources(name, found) for name, found in declared.items()}
    order = list(declared)
    pieces: Dict[str, Dict[int, DestinationPiece]] = {}
    scales: Dict[str, Dict[int, DestinationPiece]] = {}
    for d in sorted(declarations, key=lambda d: d.rank):
        for p in d.pieces:
            held = (scales if p.scale_of is not None else pieces).setdefault(p.scale_of or p.name, {})
            if d.rank in held:
                raise RefitError(
                    f"{p.name}: vLLM rank {d.rank} holds it in two parameters "
                    f"({held[d.rank].param} and {p.param}); the backend writes each checkpoint "
                    "tensor once"
                )
            held[d.rank] = p
    for name, held in pieces.items():
        if name not in sources:
            param = next(iter(held.values())).param
            raise RefitError(
                f"{name}: vLLM's parameter {param} needs this checkpoint tensor and no trainer "
                "sends it"
            )
    for name, held in scales.items():
        if name not in pieces:
            param = next(iter(held.values())).param
            raise RefitError(f"{name}: vLLM's {param} holds its scales but no rank its values")
    specs: List[TensorSpec] = []
    placed: List[Dict[int, DestinationPiece]] = []
    placed_scales: List[Dict[int, DestinationPiece]] = []
    for name in order:
        source = sources[name]
        held = pieces.get(name)
        scaled = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
        if not held and scaled in scales:
            param = next(iter(scales[scaled].values())).param
            raise RefitError(
                f"{name}: the trainer sends FP8 scales, but vLLM's {param} gets the block "
                f"scales of {scaled} computed on the way; send {scaled} in bfloat16, float16 "
                "or float32 and not its scales"
            )
        if not held:
            raise RefitError(
                f"{name}: the trainer sends it but the vLLM model has no parameter for it "
                "(an unknown name, or a tied weight that is sent once under its other name)"
            )
        first = next(iter(held.values()))
        for rank, p in held.items():
            if p.shape != first.shape or p.dtype != first.dtype:
                raise RefitError(
                    f"{name}: vLLM ranks disagree on its shape or dtype ({p.param} on rank "
                    f"{rank}: {list(p.shape)} {p.dtype}, not {list(first.shape)} {first.dtype})"
                )
        if first.block is None and source.dtype != first.dtype:
            raise RefitError(
                f"{name}: the trainer sends {source.dtype} but vLLM's {first.param} is "
                f"{first.dtype}"
            )
        boxes = {r: p.box for r, p in held.items()}
        split = source.shape != first.shape
        if split:
            splits = (
                len(source.shape) == len(first.shape) + 1
                and source.shape[0] * source.shape[1] == first.shape[0]
                and source.shape[2:] == first.shape[1:]
            )
            if not splits:
                raise RefitError(
                    f"{name}: the trainer declares shape {list(source.shape)} but vLLM's "
                    f"{first.param} takes {list(first.shape)}"
                )
            boxes = {
                r: _split_box(b, source.shape, source.shape[0], source.shape[1], r, name, held[r].param)
                for r, b in boxes.items()
            }
        layout = layout_from_boxes(f"{name} (vLLM's {first.param})", source.shape, boxes)
        scale_held = scales.get(name, {})
        if first.block is None and not scale_held:
            specs.append(TensorSpec(name, source.shape, source.dtype, source.layout, layout))
        else:
            quant = _block_quant(name, source, held, scale_held, split)
            specs.append(TensorSpec(name, source.shape, source.dtype, source.layout, layout,
                                    dst_dtype=first.dtype, quant=quant))
        placed.append(held)
        placed_scales.append(scale_held)
    return Refit(tuple(specs), tuple(placed), tuple(placed_scales))


def _block_quant(name: str, source: SourceTensor, held: Mapping[int, DestinationPiece],
                 scale_held: Mapping[int, DestinationPiece], split: bool) -> Quant:
    """The block quantization of a tensor the workers keep in FP8: the block they all declare,
    the scales stored as the dequantization multiplier (vLLM's ``weight_scale_inv``), laid out
    as the workers' scale pieces say."""
    first = next(iter(held.values()))
    blocks = {p.block for p in held.values()}
    if len(blocks) != 1 or None in blocks:
        raise RefitError(f"{name}: vLLM ranks disagree on its FP8 block ({sorted(map(str, blocks))})")
    if set(scale_held) != set(held):
        raise RefitError(
            f"{name}: vLLM ranks {sorted(held)} hold its FP8 values but ranks "
            f"{sorted(scale_held)} its scales; each rank must hold both"
        )
    if source.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise RefitError(
            f"{name}: the trainer sends {source.dtype}; vLLM's {first.param} is {first.dtype} "
            "in blocks, quantized on the way from bfloat16, float16 or float32 only"
        )
    bn, bk = first.block  # type: ignore[misc]
    scale = next(iter(scale_held.values()))
    quant = Quant("block", block=(bn, bk))
    grid = quant.scale_shape(first.shape)
    if tuple(scale.shape) != grid:
        raise RefitError(
            f"{name}: vLLM's {scale.param} holds a scale grid of {list(scale.shape)}, not the "
            f"{list(grid)} of {list(first.shape)} in {bn} x {bk} blocks"
        )
    shape: Tuple[int, ...] = grid
    boxes = {r: p.box for r, p in scale_held.items()}
    if split:
        groups, rows = source.shape[0], source.shape[1]
        if rows % bn:
            raise RefitError(
                f"{name}: the trainer declares it as {list(source.shape)}, groups of {rows} "
                f"rows, which cut vLLM's {bn}-row FP8 blocks; declare the checkpoint's shape"
            )
        shape = (groups, rows // bn) + grid[1:]
        boxes = {r: _split_box(b, shape, groups, rows // bn, r, scale.name, scale_held[r].param)
                 for r, b in boxes.items()}
    layout = layout_from_boxes(f"{scale.name} (vLLM's {scale.param})", shape, boxes)
    return Quant("block", block=(bn, bk), scale_layout=layout)
