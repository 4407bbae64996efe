"""NeMo RL's ``xferdtensor`` with ncclreshard behind it: the same signature and semantics, so a
NeMo RL refit switches with one import (python/README, "From NeMo RL").

``xferdtensor(src_tensor, src_mesh, src_placement, dst_tensor, dst_mesh, dst_placement,
process_group, stream=None)`` moves one tensor from the source mesh to the destination mesh,
called on every rank of `process_group` for every tensor of every step:

- `src_tensor` / `dst_tensor`: DTensor-like (``.shape`` the global shape, ``._local_tensor``
  this rank's shard or destination buffer; ``.dtype``), or None on the side a rank does not own;
- `src_mesh` / `dst_mesh`: DeviceMesh-like, ``.mesh`` a tensor of the group's ranks (row-major);
- `src_placement` / `dst_placement`: torch placements, one per mesh axis (``Shard``,
  ``Replicate``, ``_StridedShard``);
- `process_group`: ``.rank`` this rank in the group the meshes number; its
  ``.nccl_communicator`` (an ``ncclComm_t`` as an int, ``c_void_p``, or an object with ``.ptr``
  / ``.handle`` / ``.comm``) carries CUDA tensors through the library; without one (or for CPU
  tensors) the torch transport runs the same plan on the torch process group given as
  ``.torch_group`` (default: torch's default group), gloo included;
- `stream`: a ``torch.cuda.Stream`` (CUDA only), default the current stream.

Plans are created once per (rank, shape, dtype, meshes, placements) and reused. Unlike NCCL
M2N, uneven shards follow torch.chunk as DTensor does, any number of mesh axes and tensor dims
work, and the source and destination meshes may share ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import dtypes
from .dtensor import _placement
from .layout import Layout
from .plan import Plan
from .spec import Config, TensorSpec

_CACHE: Dict[Hashable, Tuple[Plan, Any]] = {}
_LOCK = threading.Lock()


def _mesh_of(mesh: Any, what: str) -> Tuple[Tuple[int, ...], List[int]]:
    table = getattr(mesh, "mesh", None)
    if table is None:
        table = getattr(mesh, "_mesh", None)
    if table is None:
        raise TypeError(f"{what} must be DeviceMesh-like (a .mesh tensor of ranks), got {mesh!r}")
    table = torch.as_tensor(table)
    return tuple(int(n) for n in table.shape), [int(r) for r in table.flatten().tolist()]


def _layout(mesh: Any, placements: Sequence[Any], what: str) -> Layout:
    shape, ranks = _mesh_of(mesh, f"{what}_mesh")
    places = [_placement(p, i) for i, p in enumerate(placements)]
    if len(places) != len(shape):
        raise ValueError(
            f"{what}_placement has {len(places)} entries but {what}_mesh has {len(shape)} axes"
        )
    return Layout(shape, ranks, places)


def _comm_pointer(comm: Any) -> Optional[int]:
    """The ``ncclComm_t`` address behind NeMo RL's ``nccl_communicator``, if there is one."""
    if comm is None:
        return None
    for attr in ("ptr", "handle", "comm", "_comm"):
        value = getattr(comm, attr, None)
        if value is not None and not callable(value):
            comm = value
            break
    if isinstance(comm, ctypes.c_void_p):
        return comm.value or None
    if isinstance(comm, int) and not isinstance(comm, bool):
        return comm or None
    raise TypeError(
        "process_group.nccl_communicator must be an ncclComm_t (an int, a c_void_p, or an "
        f"object with .ptr, .handle or .comm), got {comm!r}"
    )


def _local(tensor: Any, what: str) -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    local = getattr(tensor, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):
        raise TypeError(
            f"{what} must be DTensor-like (._local_tensor a torch.Tensor, .shape global) or "
            f"None, got {type(tensor).__name__}"
        )
    return local


def _plan(key: Hashable, make: Any) -> Tuple[Plan, Any]:
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            hit = make()
            _CACHE[key] = hit
        return hit


def clear_cache() -> None:
    """Destroys every cached plan (work they enqueued must be complete)."""
    with _LOCK:
        for plan, _ in _CACHE.values():
            plan.close()
        _CACHE.clear()


def xferdtensor(
    src_tensor: Any,
    src_mesh: Any,
    src_placement: Sequence[Any],
    dst_tensor: Any,
    dst_mesh: Any,
    dst_placement: Sequence[Any],
    process_group: Any,
    stream: Any = None,
) -> None:
    """Reshards one tensor from (`src_mesh`, `src_placement`) to (`dst_mesh`, `dst_placement`)
    on every rank of `process_group` (module doc). A rank in neither mesh returns at once.
    Raises TypeError/ValueError naming the argument for bad input (before anything is sent),
    and the library's errors for what it refuses."""
    src_local = _local(src_tensor, "src_tensor")
    dst_local = _local(dst_tensor, "dst_tensor")
    if src_local is None and dst_local is None:
        return
    known = src_tensor if src_tensor is not None else dst_tensor
    shape = tuple(int(n) for n in known.shape)
    dtype = getattr(known, "dtype", None) or (src_local if src_local is not None else dst_local).dtype
    for name, other in (("src_tensor", src_tensor), ("dst_tensor", dst_tensor)):
        if other is not None and tuple(int(n) for n in other.shape) != shape:
            raise ValueError(
                f"{name}.shape is {tuple(other.shape)} but the other side's is {shape}: both "
                "describe the same global tensor"
            )
    rank = getattr(process_group, "rank", None)
    if callable(rank):
        rank = rank()
    if not isinstance(rank, int):
        raise TypeError(f"process_group.rank must be an int, got {rank!r}")
    src = _layout(src_mesh, src_placement, "src")
    dst = _layout(dst_mesh, dst_placement, "dst")
    pointer = _comm_pointer(getattr(process_group, "nccl_communicator", None))
    device = (src_local if src_local is not None else dst_local).device
    use_nccl = pointer is not None and device.type == "cuda"
    key = (rank, shape, dtypes.name(dtype), src, dst, use_nccl, id(process_group))

    def make() -> Tuple[Plan, Any]:
        spec = TensorSpec("xferdtensor", shape, dtype, src, dst)
        plan = Plan([spec], rank, Config())
        if use_nccl:
            return plan, None
        from .torch_transport import TorchTransport

        return plan, TorchTransport(plan, getattr(process_group, "torch_group", None))

    plan, transport = _plan(key, make)
    on_stream = (
        torch.cuda.stream(stream)
        if stream is not None and device.type == "cuda"
        else contextlib.nullcontext()
    )
    with on_stream:
        # Plans take dense views (every rank must describe the same layouts, and a rank cannot
        # know the strides of another's buffer): strided locals go through a dense copy, made
        # and copied back on the call's stream.
        send = src_local.contiguous() if src_local is not None else None
        recv = dst_local
        if dst_local is not None and not dst_local.is_contiguous():
            recv = torch.empty_like(dst_local, memory_format=torch.contiguous_format)
        if use_nccl:
            plan.reshard([send], [recv], pointer)
        else:
            transport.reshard([send], [recv])
        if recv is not None and recv is not dst_local:
            dst_local.copy_(recv)
