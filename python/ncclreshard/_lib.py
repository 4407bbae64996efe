"""The C ABI of libncclreshard through ctypes: the library, its structs and error handling.

Everything the package computes comes from these entry points; nothing is reimplemented in
Python. The library is `$NCCL_RESHARD_LIBRARY` when set, else the copy this wheel carries. It
is loaded ``RTLD_LOCAL`` (ctypes' default), so its symbols never clash with another library's,
such as NVIDIA M2N's ``ncclReshard``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Optional

MAX_DIMS = 8
UNDEF_INT = -2147483648
CONFIG_MAGIC = 0x52455348
RANK_NONE = -1  # NCCL_RESHARD_RANK_NONE: a mesh position whose rank is gone

# ncclResult_t codes (nccl.h).
SUCCESS = 0
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
REMOTE_ERROR = 6
IN_PROGRESS = 7
_RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}


class NcclReshardError(RuntimeError):
    """A libncclreshard call failed; ``code`` is its ``ncclResult_t``, the text the library's
    ``ncclReshardGetLastError()``."""

    def __init__(self, function: str, code: int, message: str) -> None:
        self.function = function
        self.code = code
        self.message = message
        name = _RESULT_NAMES.get(code, f"ncclResult_t {code}")
        super().__init__(f"{function} returned {name}: {message}")


class InvalidArgumentError(NcclReshardError, ValueError):
    """``ncclInvalidArgument``: a descriptor field, pointer or buffer is wrong."""


class RemoteError(NcclReshardError):
    """``ncclRemoteError``: a call with a deadline missed it (a peer died, stalled or never
    called) or NCCL reported an asynchronous error; the library revoked the communicator. The
    message says which call, what had not completed and what to do next (docs/resilience.md)."""


class Placement_t(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("dim", ctypes.c_int), ("splitFactor", ctypes.c_int64)]


class Layout_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint),
        ("meshNdim", ctypes.c_int),
        ("meshShape", ctypes.c_int64 * MAX_DIMS),
        ("ranks", ctypes.POINTER(ctypes.c_int)),
        ("firstRank", ctypes.c_int),
        ("placements", Placement_t * MAX_DIMS),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
    ]


class Tensor_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("dtype", ctypes.c_int),
        ("src", ctypes.POINTER(Layout_t)),
        ("dst", ctypes.POINTER(Layout_t)),
        ("srcOffset", ctypes.c_size_t),
        ("dstOffset", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        # Added in 0.4 (conversions on the way).
        ("dstDtype", ctypes.c_int),
        ("quant", ctypes.c_void_p),
        ("scaleOffset", ctypes.c_size_t),
    ]


class Quant_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint),
        ("scheme", ctypes.c_int),
        ("blockRows", ctypes.c_int64),
        ("blockCols", ctypes.c_int64),
        ("scaleFormat", ctypes.c_int),
        ("scaleInverse", ctypes.c_int),
        ("scaleLayout", ctypes.POINTER(Layout_t)),
    ]


class Config_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("mode", ctypes.c_int),
        ("ranksPerNode", ctypes.c_int),
        ("nodeOfRank", ctypes.POINTER(ctypes.c_int)),
        ("nodeOfRankCount", ctypes.c_int),
        ("splitMinBytes", ctypes.c_size_t),
        ("maxStagingBytes", ctypes.c_size_t),
        ("rounds", ctypes.c_int),
        ("relay", ctypes.c_int),
        ("timeoutMs", ctypes.c_int),
        ("failedRanks", ctypes.POINTER(ctypes.c_int)),
        ("failedRankCount", ctypes.c_int),
        ("senderBarrier", ctypes.c_int),
    ]


class PlanInfo_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint),
        ("rank", ctypes.c_int),
        ("ntensors", ctypes.c_int),
        ("mode", ctypes.c_int),
        ("groupable", ctypes.c_int),
        ("peers", ctypes.c_int),
        ("messagesSent", ctypes.c_int64),
        ("messagesReceived", ctypes.c_int64),
        ("bytesSent", ctypes.c_uint64),
        ("bytesReceived", ctypes.c_uint64),
        ("bytesCopied", ctypes.c_uint64),
        ("stagingBytes", ctypes.c_uint64),
        ("fingerprint", ctypes.c_uint64),
        ("sendBytes", ctypes.c_uint64),
        ("recvBytes", ctypes.c_uint64),
        ("rounds", ctypes.c_int),
        # Added in 0.4.
        ("scaleTensors", ctypes.c_int),
        ("workBytes", ctypes.c_uint64),
    ]


class Transfer_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_uint),
        ("kind", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("tensor", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("globalStart", ctypes.c_int64 * MAX_DIMS),
        ("globalCount", ctypes.c_int64 * MAX_DIMS),
        ("srcOffset", ctypes.c_uint64),
        ("dstOffset", ctypes.c_uint64),
        ("chunkBytes", ctypes.c_uint64),
        ("copyNdim", ctypes.c_int),
        ("count", ctypes.c_int64 * MAX_DIMS),
        ("srcStride", ctypes.c_int64 * MAX_DIMS),
        ("dstStride", ctypes.c_int64 * MAX_DIMS),
        ("bytes", ctypes.c_uint64),
        ("round", ctypes.c_int),
        ("srcView", ctypes.c_int),
        ("blockOffset", ctypes.c_uint64),
        ("blockBytes", ctypes.c_uint64),
        # Added in 0.4 (conversions on the way).
        ("dstView", ctypes.c_int),
        ("srcDtype", ctypes.c_int),
        ("dstDtype", ctypes.c_int),
        ("scaleView", ctypes.c_int),
        ("scaleOffset", ctypes.c_uint64),
        ("scaleStride", ctypes.c_int64 * MAX_DIMS),
    ]


_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "ncclReshardPlanCreate": [ctypes.POINTER(_P), _I, ctypes.POINTER(Tensor_t), _I, ctypes.POINTER(Config_t)],
    "ncclReshardPlanDestroy": [_P],
    "ncclReshardMulti": [ctypes.POINTER(_P), ctypes.POINTER(_P), _P, _P, _P],
    "ncclReshardPlanGetInfo": [_P, ctypes.POINTER(PlanInfo_t)],
    "ncclReshardPlanGetTransfers": [_P, ctypes.POINTER(Transfer_t), _I, ctypes.POINTER(_I)],
    "ncclReshardLocalShape": [
        ctypes.POINTER(Layout_t), _I, ctypes.POINTER(ctypes.c_int64), _I,
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), _I, ctypes.POINTER(_I),
    ],
    "ncclReshardGetVersion": [ctypes.POINTER(_I)],
    # Since 0.5 (docs/resilience.md); the ncclConfig_t pointers are passed as NULL.
    "ncclReshardCommGetStatus": [_P, ctypes.POINTER(_I)],
    "ncclReshardCommWait": [_P],
    "ncclReshardCommRevoke": [_P],
    "ncclReshardCommShrink": [_P, ctypes.POINTER(_I), _I, ctypes.POINTER(_P), _P, _I],
    "ncclReshardCommGetUniqueId": [_P, ctypes.c_char_p],
    "ncclReshardCommGrow": [_P, _I, ctypes.c_char_p, _I, ctypes.POINTER(_P), _P],
    "ncclReshardGetNcclLibrary": [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_I)],
}


def library_path() -> Path:
    """The libncclreshard file used: ``$NCCL_RESHARD_LIBRARY``, else the wheel's copy."""
    override = os.environ.get("NCCL_RESHARD_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / "lib" / "libncclreshard.so"


def _package_version() -> Optional[str]:
    try:
        from ._version import __version__
    except ImportError:  # a source tree that setup.py has not built
        return None
    return __version__


def _code(version: str) -> int:
    major, minor, patch = (int(part) for part in version.split(".")[:3])
    return major * 10000 + minor * 100 + patch


class _Library:
    """The loaded library with typed entry points and the struct version to write."""

    def __init__(self) -> None:
        path = library_path()
        if not path.is_file():
            raise ImportError(
                f"libncclreshard not found at {path}: install the package with "
                "`pip install ./python` from the repository (it builds the library), or set "
                "NCCL_RESHARD_LIBRARY to a libncclreshard.so"
            )
        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            function = getattr(self.cdll, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        self.cdll.ncclReshardGetLastError.restype = ctypes.c_char_p
        self.cdll.ncclReshardGetLastError.argtypes = []
        version = ctypes.c_int()
        self.call("ncclReshardGetVersion", ctypes.byref(version))
        self.library_version_code = version.value
        package = _package_version()
        # The structs above are this package's; a library older than them would refuse them
        # (fields are only appended), a newer one reads the fields they have.
        self.struct_version = _code(package) if package else version.value
        if version.value < self.struct_version:
            raise ImportError(
                f"{path} is libncclreshard {version.value}, older than this package's "
                f"{self.struct_version}; point NCCL_RESHARD_LIBRARY at a newer one or unset it"
            )

    def call(self, function: str, *args: object) -> None:
        """Calls `function`; raises NcclReshardError (InvalidArgumentError for
        ncclInvalidArgument) with the library's message when it does not return ncclSuccess."""
        code = getattr(self.cdll, function)(*args)
        if code != SUCCESS:
            message = (self.cdll.ncclReshardGetLastError() or b"").decode(errors="replace")
            raise error(function, code, message)


def error(function: str, code: int, message: str) -> NcclReshardError:
    """The exception for `code`: InvalidArgumentError, RemoteError or NcclReshardError."""
    kind = {INVALID_ARGUMENT: InvalidArgumentError, REMOTE_ERROR: RemoteError}.get(
        code, NcclReshardError
    )
    return kind(function, code, message)


_loaded: Optional[_Library] = None
_lock = threading.Lock()


def lib() -> _Library:
    """The library, loaded at first use."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _Library()
        return _loaded
