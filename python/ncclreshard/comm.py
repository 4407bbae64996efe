"""NCCL communicators for :meth:`Plan.reshard`: taken from PyTorch's ``ProcessGroupNCCL`` or
vLLM's ``PyNcclCommunicator``, or made fresh over trainer and inference processes through a
``torch.distributed`` store. Every one must come from the NCCL libncclreshard uses
(:func:`nccl_library`); the functions here check that where they can."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, Sequence, Union

import torch

from . import _lib, nccl

_UNIQUE_ID_BYTES = 128


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _UNIQUE_ID_BYTES)]


class Communicator:
    """An ``ncclComm_t`` with its rank and size. One made by :func:`init_comm` is owned and
    destroyed by :meth:`close`; one borrowed from torch or vLLM is never destroyed here."""

    def __init__(self, handle: int, rank: int, size: int, owned: bool = False) -> None:
        if not handle:
            raise ValueError("Communicator: the ncclComm_t is NULL")
        self.handle = handle
        self.rank = rank
        self.size = size
        self.owned = owned

    def close(self) -> None:
        """Destroys an owned communicator (``ncclCommDestroy``); a no-op otherwise."""
        if self.owned and self.handle:
            lib = nccl.cdll()
            lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
            _check(lib, lib.ncclCommDestroy(ctypes.c_void_p(self.handle)), "ncclCommDestroy")
            self.handle = 0

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, handle={self.handle:#x})"


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        text = (lib.ncclGetErrorString(code) or b"").decode(errors="replace")
        raise RuntimeError(f"{what} returned {code} ({text})")


def _count_and_rank(handle: int) -> "tuple[int, int]":
    lib = nccl.cdll()
    count, rank = ctypes.c_int(), ctypes.c_int()
    for name, out in (("ncclCommCount", count), ("ncclCommUserRank", rank)):
        function = getattr(lib, name)
        function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        _check(lib, function(ctypes.c_void_p(handle), ctypes.byref(out)), name)
    return count.value, rank.value


def _torch_nccl_library() -> Optional[ctypes.CDLL]:
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    path = os.path.join(lib_dir, "libtorch_cuda.so")
    return ctypes.CDLL(path) if os.path.exists(path) else None


def comm_from_process_group(group: Any = None, device: Optional[torch.device] = None) -> Communicator:
    """The ``ncclComm_t`` of a torch ``ProcessGroupNCCL`` (default: the default group) for
    `device` (default: the current CUDA device). The group's ranks are the communicator's.

    The communicator exists once the group ran a collective on that device or was created
    with ``init_process_group(..., device_id=...)``. Raises TypeError for a group without an
    NCCL backend, ValueError when its communicator does not exist yet, RuntimeError when
    torch's NCCL is not the one libncclreshard uses.
    """
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    try:
        backend = group._get_backend(device)
    except Exception as missing:
        raise TypeError(f"process group {group!r} has no NCCL backend for {device}") from missing
    if not hasattr(backend, "_comm_ptr"):
        raise TypeError(f"process group backend {type(backend).__name__} is not ProcessGroupNCCL")
    handle = int(backend._comm_ptr())
    if not handle:
        raise ValueError(
            "the process group has no NCCL communicator yet: run a collective on it first, or "
            "create it with init_process_group(..., device_id=torch.device('cuda', i))"
        )
    torch_nccl = _torch_nccl_library()
    if torch_nccl is not None and not nccl.is_same_nccl(torch_nccl):
        raise RuntimeError(
            f"torch's NCCL is not the one libncclreshard uses ({nccl.nccl_library().path}); "
            "unset NCCL_RESHARD_NCCL_LIBRARY or point it at torch's libnccl"
        )
    size, rank = _count_and_rank(handle)
    return Communicator(handle, rank, size)


def comm_from_pynccl(communicator: Any) -> Communicator:
    """The ``ncclComm_t`` of a vLLM ``PyNcclCommunicator`` (``.comm``, ``.nccl``).

    Raises TypeError for another object, RuntimeError when its NCCL (``.nccl.lib``) is not
    the one libncclreshard uses (vLLM: ``VLLM_NCCL_SO_PATH``; this library:
    ``NCCL_RESHARD_NCCL_LIBRARY``; point both at one file).
    """
    comm = getattr(communicator, "comm", None)
    if comm is None:
        raise TypeError(f"expected a vLLM PyNcclCommunicator, got {type(communicator).__name__}")
    handle = comm.value if isinstance(comm, ctypes.c_void_p) else int(comm)
    if not handle:
        raise ValueError("the PyNcclCommunicator has no communicator (disabled or world size 1)")
    theirs = getattr(getattr(communicator, "nccl", None), "lib", None)
    if isinstance(theirs, ctypes.CDLL) and not nccl.is_same_nccl(theirs):
        raise RuntimeError(
            f"vLLM's NCCL ({getattr(theirs, '_name', theirs)}) is not the one libncclreshard uses "
            f"({nccl.nccl_library().path}); set VLLM_NCCL_SO_PATH and NCCL_RESHARD_NCCL_LIBRARY "
            "to one file"
        )
    size, rank = _count_and_rank(handle)
    return Communicator(handle, rank, size)


def init_comm(
    world_size: int,
    rank: int,
    store: Any,
    device: Union[int, torch.device, None] = None,
    key: str = "ncclreshard/unique_id",
) -> Communicator:
    """A fresh communicator of `world_size` ranks over any processes (trainer + inference),
    the way RL stacks build their weight-update group: rank 0 makes an ``ncclUniqueId`` and
    publishes it under `key` in `store` (a ``torch.distributed`` ``TCPStore`` every process
    reaches); every rank then calls ``ncclCommInitRank`` on `device` (default: the current CUDA
    device) with the NCCL libncclreshard uses. Collective: every rank must call it. Use a new
    `key` for each communicator made over the same store.

    Raises ValueError for a rank outside ``0..world_size-1``, RuntimeError for NCCL errors.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if device is not None:
        torch.cuda.set_device(device)
    lib = nccl.cdll()
    if rank == 0:
        unique = NcclUniqueId()
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        _check(lib, lib.ncclGetUniqueId(ctypes.byref(unique)), "ncclGetUniqueId")
        store.set(key, bytes(unique))
    raw = store.get(key)
    unique = NcclUniqueId.from_buffer_copy(raw)
    handle = ctypes.c_void_p()
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId, ctypes.c_int]
    _check(lib, lib.ncclCommInitRank(ctypes.byref(handle), world_size, unique, rank), "ncclCommInitRank")
    return Communicator(handle.value or 0, rank, world_size, owned=True)


# Failures (docs/resilience.md): the outcome of calls with a deadline, and the communicator
# operations that recover from a rank that is gone, through the NCCL the library uses.

_STATUS = {_lib.SUCCESS: "ok", _lib.IN_PROGRESS: "running", _lib.REMOTE_ERROR: "failed"}


def comm_status(comm: Any) -> str:
    """The outcome of this rank's calls with a deadline on `comm`, without waiting
    (``ncclReshardCommGetStatus``): ``"ok"`` (none running, none failed), ``"running"`` (one
    is still within its deadline) or ``"failed"`` (one missed its deadline or NCCL reported an
    asynchronous error, and the library revoked `comm`; :func:`comm_wait` raises the detail).
    Calls without a deadline are not counted."""
    status = ctypes.c_int()
    _lib.lib().call("ncclReshardCommGetStatus", comm_handle(comm), ctypes.byref(status))
    return _STATUS.get(status.value, f"ncclResult_t {status.value}")


def comm_wait(comm: Any) -> None:
    """Waits until none of this rank's calls with a deadline on `comm` is running
    (``ncclReshardCommWait``; bounded by their deadlines once the streams reached them) and
    raises :class:`RemoteError` if one failed: its message names the call, the round and peers
    that had not completed, and the next steps (:func:`comm_shrink`, a plan with
    ``Config(failed_ranks=...)``, call again). The failure stays until `comm` is shrunk."""
    _lib.lib().call("ncclReshardCommWait", comm_handle(comm))


def comm_revoke(comm: Any) -> None:
    """Revokes `comm` now (``ncclReshardCommRevoke``), for an application that learned
    otherwise that a rank is gone: everything pending on it ends, running calls with a deadline
    fail, further calls on it are refused; then every survivor calls :func:`comm_shrink`. With
    an NCCL older than 2.28.7 the communicator is aborted instead (do not close it then)."""
    _lib.lib().call("ncclReshardCommRevoke", comm_handle(comm))


def comm_shrink(comm: Any, failed_ranks: Sequence[int], abort: bool = True) -> Communicator:
    """The survivors' communicator (``ncclReshardCommShrink``, NCCL 2.27.3 or newer): every
    survivor (and only they) calls it with the same `failed_ranks` (ranks of `comm`); each keeps
    its order, its rank less the failed ranks below it. `abort` (``NCCL_SHRINK_ABORT``, the
    default) ends whatever is pending on `comm` first, as after a failure; ``abort=False``
    needs `comm` idle (a revoked `comm` is always shrunk with abort). Collective over the
    survivors; returns an owned :class:`Communicator` (close it when done) after which `comm`'s
    failure is forgotten: close or drop `comm` (``ncclCommDestroy`` for an owned one).

    Raises ValueError for a bad or empty list, NcclReshardError for what NCCL or the library refuses
    (an NCCL without ``ncclCommShrink`` names the version needed)."""
    failed = [int(r) for r in failed_ranks]
    if not failed:
        raise ValueError(
            "failed_ranks is empty: NCCL shrinks by one rank or more; with every rank alive after "
            "a revoke, make a new communicator"
        )
    if len(set(failed)) != len(failed) or any(r < 0 for r in failed):
        raise ValueError(f"failed_ranks {failed} must be distinct non-negative ranks")
    table = (ctypes.c_int * max(1, len(failed)))(*failed)
    new = ctypes.c_void_p()
    _lib.lib().call(
        "ncclReshardCommShrink", comm_handle(comm), table, len(failed), ctypes.byref(new), None,
        1 if abort else 0,
    )
    size, rank = _count_and_rank(new.value or 0)
    return Communicator(new.value or 0, rank, size, owned=True)


def comm_get_unique_id(comm: Any) -> bytes:
    """The ``ncclUniqueId`` with which ranks join `comm` in :func:`comm_grow`
    (``ncclReshardCommGetUniqueId``, NCCL 2.29.2 or newer), made by the coordinator of the
    grow: pass it to the new ranks out of band (e.g. a ``torch.distributed`` store)."""
    unique = ctypes.create_string_buffer(_UNIQUE_ID_BYTES)
    _lib.lib().call("ncclReshardCommGetUniqueId", comm_handle(comm), unique)
    return unique.raw


def comm_grow(
    comm: Any, world_size: int, unique_id: Optional[bytes] = None, rank: Optional[int] = None
) -> Communicator:
    """The communicator grown to `world_size` ranks (``ncclReshardCommGrow``, NCCL 2.29.2 or
    newer): ranks of `comm` pass it, with `unique_id` on the coordinator only (from
    :func:`comm_get_unique_id`); new ranks pass `comm` None, the coordinator's `unique_id` and
    their `rank` (from the old size to ``world_size - 1``). Collective over old and new ranks;
    returns an owned :class:`Communicator`; close the old one afterwards. Plans for it name
    the new ranks in their layouts."""
    if unique_id is not None and len(unique_id) != _UNIQUE_ID_BYTES:
        raise ValueError(f"unique_id has {len(unique_id)} bytes; an ncclUniqueId has {_UNIQUE_ID_BYTES}")
    if comm is None and (unique_id is None or rank is None):
        raise ValueError("a new rank (comm None) passes the coordinator's unique_id and its rank")
    parent = None if comm is None else comm_handle(comm)
    new = ctypes.c_void_p()
    _lib.lib().call(
        "ncclReshardCommGrow", parent, world_size, unique_id, -1 if rank is None else rank,
        ctypes.byref(new), None,
    )
    size, new_rank = _count_and_rank(new.value or 0)
    return Communicator(new.value or 0, new_rank, size, owned=True)


def comm_handle(comm: Any) -> int:
    """The ``ncclComm_t`` address of `comm` (a :class:`Communicator`, a ``c_void_p`` or an
    int); TypeError for anything else or NULL."""
    handle = getattr(comm, "handle", comm)
    if isinstance(handle, ctypes.c_void_p):
        handle = handle.value or 0
    if isinstance(handle, bool) or not isinstance(handle, int) or handle == 0:
        raise TypeError(
            "comm must be an ncclreshard Communicator (comm_from_process_group, "
            f"comm_from_pynccl, init_comm, comm_shrink) or a non-NULL ncclComm_t address, got {comm!r}"
        )
    return handle
