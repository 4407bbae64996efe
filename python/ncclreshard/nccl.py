"""Which libnccl the library uses, and the functions of that same NCCL.

A communicator is only valid in the libnccl that created it. The library picks its NCCL once
per process by a fixed rule (``ncclReshardGetNcclLibrary`` in ``ncclReshard.h``): the one named
by ``NCCL_RESHARD_NCCL_LIBRARY`` if it is the NCCL already in the process or none is; else the
global one; else the one NCCL mapped privately (how Python loads PyTorch's and vLLM's); else
``libnccl.so.2``. Naming another file while an NCCL is mapped, or two private copies, is
refused. This module reports the choice and calls NCCL only through it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple, Optional

from . import _lib


class NcclLibrary(NamedTuple):
    """The NCCL libncclreshard uses: the file that defines its functions and its
    ``ncclGetVersion`` code (e.g. 22805 for 2.28.5)."""

    path: str
    version: int


_lock = threading.Lock()
_cdll: Optional[ctypes.CDLL] = None


def nccl_library() -> NcclLibrary:
    """The libnccl the library uses, loading it by the rule above if no call has yet.

    Raises NcclReshardError (``ncclSystemError``) when no NCCL can be loaded or the rule
    refuses (the message names the files and what to set).
    """
    path = ctypes.c_char_p()
    version = ctypes.c_int()
    _lib.lib().call("ncclReshardGetNcclLibrary", ctypes.byref(path), ctypes.byref(version))
    return NcclLibrary((path.value or b"").decode(), version.value)


def cdll() -> ctypes.CDLL:
    """NCCL's functions from the library's own NCCL (opening a mapped file again returns the
    copy already mapped, never a second one)."""
    global _cdll
    with _lock:
        if _cdll is None:
            _cdll = ctypes.CDLL(nccl_library().path)
        return _cdll


def function_address(library: ctypes.CDLL, name: str = "ncclSend") -> Optional[int]:
    """Where `name` resolves from `library` (its own definition or a dependency's), or None."""
    try:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        return None


def is_same_nccl(library: ctypes.CDLL) -> bool:
    """True when `library` (a ctypes handle of a libnccl, or of a library linked to one) leads
    to the NCCL libncclreshard uses: both resolve ``ncclSend`` to one definition."""
    theirs = function_address(library)
    return theirs is not None and theirs == function_address(cdll())
