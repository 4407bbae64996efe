"""Element types: torch dtypes and NCCL's ``ncclDataType_t`` codes (nccl.h), the names the
case files use (torch's)."""

from __future__ import annotations

from typing import Union

import torch

# (torch dtype, ncclDataType_t). NCCL's enum values are part of its ABI.
_NCCL_CODES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.uint32: 3,
    torch.int64: 4,
    torch.uint64: 5,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
    torch.float8_e4m3fn: 10,
    torch.float8_e5m2: 11,
}

DTypeLike = Union[torch.dtype, str]


def name(dtype: torch.dtype) -> str:
    """torch's name of `dtype` (``torch.bfloat16`` → ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def to_dtype(value: DTypeLike, what: str = "dtype") -> torch.dtype:
    """A supported torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``).

    Raises TypeError for another type of value, ValueError for a dtype NCCL cannot carry.
    """
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{what}: unknown dtype {value!r}; expected one of {supported()}")
        value = found
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{what}: expected a torch.dtype or its name, got {type(value).__name__}")
    if value not in _NCCL_CODES:
        raise ValueError(f"{what}: {value} has no NCCL type; expected one of {supported()}")
    return value


def nccl_code(dtype: torch.dtype) -> int:
    """The ``ncclDataType_t`` value of a supported dtype."""
    return _NCCL_CODES[dtype]


def from_nccl_code(code: int) -> "torch.dtype | None":
    """The torch dtype of an ``ncclDataType_t`` value (None for an unknown one)."""
    return next((d for d, c in _NCCL_CODES.items() if c == code), None)


def supported() -> str:
    return ", ".join(name(d) for d in _NCCL_CODES)
