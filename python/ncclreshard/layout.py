"""One side of a reshard: a device mesh of communicator ranks and one placement per mesh
axis (docs/design.md §2: PyTorch DTensor's rules), and a rank's local shape under it."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _lib, placements as _placements
from .placements import Placement

RankMap = Union[Mapping[int, int], Sequence[int], Callable[[int], int]]


def _ints(values: object, what: str, minimum: int) -> Tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for i, value in enumerate(values):  # type: ignore[attr-defined]
        if hasattr(value, "item") and not isinstance(value, int):
            value = value.item()  # a torch or numpy scalar
        out.append(_placements._index(value, f"{what}[{i}]", minimum))
    return tuple(out)


@dataclass(frozen=True, init=False)
class Layout:
    """A mesh (shape and row-major rank table, like ``DeviceMesh(mesh=...)``) and one placement
    per mesh axis. ``strides``, when given, are the element strides of every rank's local view
    (a view into a larger buffer, e.g. one half of a fused parameter); ``None`` is dense
    row-major.

    ``ranks`` is the row-major rank table (a flat or nested sequence, or a torch tensor of the
    mesh's shape), or one int: the first of contiguous ranks. ``None`` in the table is a
    position whose rank is gone (``NCCL_RESHARD_RANK_NONE``): its shard is then held only by
    replicas elsewhere in the mesh, if any.
    """

    mesh_shape: Tuple[int, ...]
    ranks: Tuple[Optional[int], ...]
    placements: Tuple[Placement, ...]
    strides: Optional[Tuple[int, ...]]

    def __init__(
        self,
        mesh_shape: Sequence[int],
        ranks: Union[int, Sequence[Any], Any],
        placements: Sequence[Placement],
        strides: Optional[Sequence[int]] = None,
    ) -> None:
        shape = _ints(mesh_shape, "mesh_shape", 1)
        if not 1 <= len(shape) <= _lib.MAX_DIMS:
            raise ValueError(f"mesh_shape {list(shape)} has {len(shape)} axes; 1 to 8 allowed")
        size = math.prod(shape)
        if isinstance(ranks, bool):
            raise TypeError("ranks must be an int (first rank) or a rank table, got bool")
        if isinstance(ranks, int):
            _placements._index(ranks, "ranks (first rank)", 0)
            table = tuple(range(ranks, ranks + size))
        else:
            if hasattr(ranks, "flatten") and hasattr(ranks, "tolist"):
                ranks = ranks.flatten().tolist()  # a torch tensor, as DeviceMesh.mesh
            flat = _flatten(ranks)
            table = tuple(
                None if v is None else _ints([v], f"ranks[{i}]", 0)[0] for i, v in enumerate(flat)
            )
            if len(table) != size:
                raise ValueError(
                    f"ranks has {len(table)} entries but mesh_shape {list(shape)} holds {size}"
                )
            live = [r for r in table if r is not None]
            if len(set(live)) != len(live):
                raise ValueError(f"ranks {list(table)} has a rank twice")
        places = tuple(placements)
        if len(places) != len(shape):
            raise ValueError(
                f"placements has {len(places)} entries but the mesh has {len(shape)} axes"
            )
        for i, p in enumerate(places):
            _placements.to_c(p, f"placements[{i}]")
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "ranks", table)
        object.__setattr__(self, "placements", places)
        object.__setattr__(
            self, "strides", None if strides is None else _ints(strides, "strides", 0)
        )

    @property
    def first_rank(self) -> Optional[int]:
        """The first rank when the table is contiguous, else None."""
        first = self.ranks[0]
        if first is None:
            return None
        return first if self.ranks == tuple(range(first, first + len(self.ranks))) else None

    @property
    def live_ranks(self) -> Tuple[int, ...]:
        """The ranks of the table, holes left out."""
        return tuple(r for r in self.ranks if r is not None)

    def with_strides(self, strides: Optional[Sequence[int]]) -> "Layout":
        """The same layout with local views of these element strides (None: dense)."""
        return Layout(self.mesh_shape, self.ranks, self.placements, strides)

    def to_json(self) -> dict:
        """The case-file side object: ``{"mesh", "first_rank" | "ranks", "placements",
        "strides"?}``."""
        out: dict = {"mesh": list(self.mesh_shape)}
        if self.first_rank is not None:
            out["first_rank"] = self.first_rank
        else:
            out["ranks"] = list(self.ranks)
        out["placements"] = [str(p) for p in self.placements]
        if self.strides is not None:
            out["strides"] = list(self.strides)
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any], what: str = "layout") -> "Layout":
        """A layout from a case-file side object; ValueError/TypeError name the key."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
        unknown = set(value) - {"mesh", "ranks", "first_rank", "placements", "strides"}
        if unknown:
            raise ValueError(f"{what}.{sorted(unknown)[0]}: unknown key")
        for key in ("mesh", "placements"):
            if key not in value:
                raise ValueError(f"{what}.{key}: missing; this key is required")
        if "ranks" in value and "first_rank" in value:
            raise ValueError(f"{what}.first_rank: give either ranks or first_rank, not both")
        ranks = value["ranks"] if "ranks" in value else value.get("first_rank", 0)
        places = [
            _placements.parse(p, f"{what}.placements[{i}]")
            for i, p in enumerate(value["placements"])
        ]
        return cls(value["mesh"], ranks, places, value.get("strides"))

    @classmethod
    def from_dtensor(cls, dtensor_or_spec: Any, rank_map: Optional[RankMap] = None) -> "Layout":
        """The layout of a DTensor (or its ``DTensorSpec``): its ``device_mesh``'s rank table
        and its placements (``Shard``, ``Replicate``, ``_StridedShard``).

        ``rank_map`` turns the mesh's ranks (global ranks of torch's default process group)
        into ranks of the reshard communicator: a mapping, a sequence indexed by torch rank, or
        a function; by default they are the same. Raises ValueError for ``Partial`` (reduce
        first) and for a rank the map does not cover, TypeError for anything not a DTensor.
        """
        from .dtensor import layout_of

        return layout_of(dtensor_or_spec, rank_map)

    def c_struct(self, version: int, what: str) -> Tuple[_lib.Layout_t, List[object]]:
        """The C struct and the arrays it points to (keep them alive while it is used)."""
        c = _lib.Layout_t()
        c.size = ctypes.sizeof(_lib.Layout_t)
        c.version = version
        c.meshNdim = len(self.mesh_shape)
        for i, n in enumerate(self.mesh_shape):
            c.meshShape[i] = n
        ranks = (ctypes.c_int * len(self.ranks))(
            *[_lib.RANK_NONE if r is None else r for r in self.ranks]
        )
        c.ranks = ctypes.cast(ranks, ctypes.POINTER(ctypes.c_int))
        for i, p in enumerate(self.placements):
            c.placements[i] = _placements.to_c(p, f"{what}.placements[{i}]")
        keep: List[object] = [ranks]
        if self.strides is not None:
            strides = (ctypes.c_int64 * max(1, len(self.strides)))(*self.strides)
            c.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
            keep.append(strides)
        return c, keep


def _flatten(values: Any) -> List[Any]:
    out: List[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out


def _local(
    layout: Layout, shape: Sequence[int], rank: int, with_runs: bool
) -> Tuple[Tuple[int, ...], List[List[Tuple[int, int]]]]:
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, got {type(layout).__name__}")
    dims = _ints(shape, "shape", 0)
    if len(dims) > _lib.MAX_DIMS:
        raise ValueError(f"shape {list(dims)} has {len(dims)} dims; at most 8 allowed")
    _placements._index(rank, "rank", 0)
    library = _lib.lib()
    c, keep = layout.c_struct(library.struct_version, "layout")
    n = len(dims)
    shape_c = (ctypes.c_int64 * max(1, n))(*dims)
    local = (ctypes.c_int64 * max(1, n))()
    per_dim = (ctypes.c_int * max(1, n))()
    library.call(
        "ncclReshardLocalShape", ctypes.byref(c), n, shape_c, rank, local, None, 0, per_dim
    )
    runs: List[List[Tuple[int, int]]] = []
    if with_runs:
        total = sum(per_dim[i] for i in range(n))
        flat = (ctypes.c_int64 * max(1, 2 * total))()
        library.call(
            "ncclReshardLocalShape", ctypes.byref(c), n, shape_c, rank, local, flat,
            total, per_dim,
        )
        at = 0
        for d in range(n):
            runs.append([(flat[2 * (at + k)], flat[2 * (at + k) + 1]) for k in range(per_dim[d])])
            at += per_dim[d]
    del keep
    return tuple(local[i] for i in range(n)), runs


def local_shape(layout: Layout, shape: Sequence[int], rank: int) -> Tuple[int, ...]:
    """The shape of `rank`'s local tensor under `layout` for a global tensor of `shape`
    (``ncclReshardLocalShape``): what DTensor's ``to_local()`` has on that rank.

    Raises ValueError (the library's ``InvalidArgumentError``) for a rank not in the mesh, a
    placement dim past the tensor's dims and other bad fields, each named.
    """
    return _local(layout, shape, rank, False)[0]


def local_runs(layout: Layout, shape: Sequence[int], rank: int) -> List[List[Tuple[int, int]]]:
    """The global indices `rank` holds, per dim, as ``[start, end)`` runs in local order: its
    local tensor is the global tensor indexed by their Cartesian product. Errors as
    :func:`local_shape`."""
    return _local(layout, shape, rank, True)[1]
