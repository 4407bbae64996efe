"""What a reshard plan is made from: :class:`TensorSpec` (one global tensor and its two
layouts), :class:`Config` (plan options) and :class:`Case` (tensors + config), with JSON in
exactly the case-file format the ``ncclreshard`` CLI reads (README "Case files"), so a trainer
can ship specs to inference workers and ``ncclreshard check`` can replay them."""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from . import _lib, dtypes
from .layout import Layout, _ints
from .placements import _index

MODES = {"groupable": 0, "staged": 1, "auto": 2}
# The config keys of case files (the deadline is a run-time setting, not part of a case).
_CASE_KEYS = (
    "mode", "ranks_per_node", "node_of_rank", "split_min_bytes", "rounds", "relay",
    "sender_barrier", "failed_ranks",
)
# ncclReshardQuantScheme_t and ncclReshardScaleFormat_t, by their case-file names.
SCHEMES = {"none": 0, "per_tensor": 1, "per_channel": 2, "block": 3}
SCALE_FORMATS = {"float32": 0, "e8m0": 1}


@dataclass(frozen=True)
class Quant:
    """How a tensor is quantized on its way (docs/quantization.md): ``scheme`` ``"none"`` (a
    plain cast), ``"per_tensor"``, ``"per_channel"`` or ``"block"`` (``block`` = (rows, cols),
    default (128, 128)); scales as ``scale_format`` ``"float32"`` or ``"e8m0"``, stored as the
    dequantization multiplier (DeepSeek's ``weight_scale_inv``) or with ``scale_inverse`` its
    reciprocal, on ``scale_layout`` (``None``: the tensor's destination mesh and placements)."""

    scheme: str = "block"
    block: Optional[Tuple[int, int]] = None
    scale_format: str = "float32"
    scale_inverse: bool = False
    scale_layout: Optional[Layout] = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"Quant.scheme is {self.scheme!r}; expected one of {list(SCHEMES)}")
        if self.block is not None:
            if self.scheme != "block":
                raise ValueError(f"Quant.block: only the block scheme has blocks, not {self.scheme!r}")
            block = _ints(self.block, "Quant.block", 1)
            if len(block) != 2:
                raise ValueError(f"Quant.block is {list(block)}; expected (rows, cols)")
            object.__setattr__(self, "block", block)
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(
                f"Quant.scale_format is {self.scale_format!r}; expected one of {list(SCALE_FORMATS)}"
            )
        if not isinstance(self.scale_inverse, bool):
            raise TypeError(f"Quant.scale_inverse must be a bool, got {type(self.scale_inverse).__name__}")
        if self.scale_layout is not None and not isinstance(self.scale_layout, Layout):
            raise TypeError(f"Quant.scale_layout must be a Layout, got {type(self.scale_layout).__name__}")

    def block_shape(self, shape: Sequence[int]) -> Tuple[int, ...]:
        """A block's extent along each dim of a tensor of global `shape` (docs/quantization.md
        §3; trailing blocks are short): 1 everywhere for a plain cast, the whole tensor per
        tensor, the last dim per channel, ``block`` on the last two dims (a 1-D tensor: cols)."""
        n = len(shape)
        rows, cols = self.block if self.block is not None else (128, 128)
        whole = [max(int(d), 1) for d in shape]
        if self.scheme == "none":
            return (1,) * n
        if self.scheme == "per_tensor":
            return tuple(whole)
        if self.scheme == "per_channel":
            return tuple(whole[d] if d == n - 1 else 1 for d in range(n))
        return tuple(cols if d == n - 1 else rows if d == n - 2 else 1 for d in range(n))

    def scale_shape(self, shape: Sequence[int]) -> Tuple[int, ...]:
        """The scale tensor's global shape: the number of blocks along each dim."""
        return tuple(-(-int(n) // b) for n, b in zip(shape, self.block_shape(shape)))

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype of scale views: float32, or uint8 for E8M0 (one biased exponent byte)."""
        return torch.uint8 if self.scale_format == "e8m0" else torch.float32

    def to_json(self) -> dict:
        """The case-file ``quant`` object (defaults left out)."""
        out: dict = {"scheme": self.scheme}
        if self.block is not None:
            out["block"] = list(self.block)
        if self.scale_format != "float32":
            out["scale_format"] = self.scale_format
        if self.scale_inverse:
            out["scale_inverse"] = True
        if self.scale_layout is not None:
            out["scale_layout"] = self.scale_layout.to_json()
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any], what: str = "quant") -> "Quant":
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
        known = {"scheme", "block", "scale_format", "scale_inverse", "scale_layout"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"{what}.{sorted(unknown)[0]}: unknown key")
        if "scheme" not in value:
            raise ValueError(f"{what}.scheme: missing; this key is required")
        args = {k: value[k] for k in known - {"scale_layout"} if k in value}
        if "block" in args:
            args["block"] = tuple(args["block"])
        if "scale_layout" in value:
            args["scale_layout"] = Layout.from_json(value["scale_layout"], f"{what}.scale_layout")
        try:
            return cls(**args)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}: {e}") from None

    def c_struct(self, version: int, what: str) -> Tuple[_lib.Quant_t, List[object]]:
        """The C struct (NCCL_RESHARD_QUANT_INITIALIZER with the set fields)."""
        c = _lib.Quant_t()
        c.size = ctypes.sizeof(_lib.Quant_t)
        c.version = version
        c.scheme = SCHEMES[self.scheme]
        c.blockRows, c.blockCols = self.block if self.block is not None else (0, 0)
        c.scaleFormat = SCALE_FORMATS[self.scale_format]
        c.scaleInverse = int(self.scale_inverse)
        keep: List[object] = []
        if self.scale_layout is not None:
            layout, keep_layout = self.scale_layout.c_struct(version, f"{what}.scaleLayout")
            c.scaleLayout = ctypes.pointer(layout)
            keep += [layout, keep_layout]
        return c, keep


@dataclass(frozen=True, init=False)
class TensorSpec:
    """One global tensor: ``name`` (used in messages; optional), global ``shape``, torch
    ``dtype``, and its ``src`` and ``dst`` layouts. Every rank must use identical specs.

    A tensor may arrive in another dtype, ``dst_dtype`` (``None``: ``dtype``), cast on the way,
    or quantized as ``quant`` (a :class:`Quant`; FP8 ``dst_dtype`` only) with its scales
    written to a scale tensor of their own (docs/quantization.md)."""

    name: Optional[str]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    src: Layout
    dst: Layout
    dst_dtype: Optional[torch.dtype]
    quant: Optional[Quant]

    def __init__(
        self,
        name: Optional[str],
        shape: Sequence[int],
        dtype: dtypes.DTypeLike,
        src: Layout,
        dst: Layout,
        dst_dtype: Optional[dtypes.DTypeLike] = None,
        quant: Optional[Quant] = None,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"TensorSpec name must be a str or None, got {type(name).__name__}")
        what = f"tensor {name!r}" if name else "TensorSpec"
        dims = _ints(shape, f"{what}: shape", 0)
        if len(dims) > _lib.MAX_DIMS:
            raise ValueError(f"{what}: shape {list(dims)} has {len(dims)} dims; at most 8")
        for side, layout in (("src", src), ("dst", dst)):
            if not isinstance(layout, Layout):
                raise TypeError(f"{what}: {side} must be a Layout, got {type(layout).__name__}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", dtypes.to_dtype(dtype, f"{what}: dtype"))
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)
        if quant is not None and not isinstance(quant, Quant):
            raise TypeError(f"{what}: quant must be a Quant, got {type(quant).__name__}")
        if quant is not None and dst_dtype is None:
            raise ValueError(f"{what}: quant needs dst_dtype (float8_e4m3fn or float8_e5m2)")
        object.__setattr__(
            self,
            "dst_dtype",
            None if dst_dtype is None else dtypes.to_dtype(dst_dtype, f"{what}: dst_dtype"),
        )
        object.__setattr__(self, "quant", quant)

    def label(self, index: int) -> str:
        """How messages name this tensor: ``tensors[2] ('model.x.weight')``."""
        return f"tensors[{index}] ({self.name!r})" if self.name else f"tensors[{index}]"

    def to_json(self) -> dict:
        """The case-file tensor object: ``{"name"?, "shape", "dtype", "src", "dst",
        "dst_dtype"?, "quant"?}``."""
        out: dict = {}
        if self.name is not None:
            out["name"] = self.name
        out["shape"] = list(self.shape)
        out["dtype"] = dtypes.name(self.dtype)
        out["src"] = self.src.to_json()
        out["dst"] = self.dst.to_json()
        if self.dst_dtype is not None:
            out["dst_dtype"] = dtypes.name(self.dst_dtype)
        if self.quant is not None:
            out["quant"] = self.quant.to_json()
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any], what: str = "tensor") -> "TensorSpec":
        """A spec from a case-file tensor object; errors name the key."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
        unknown = set(value) - {"name", "shape", "dtype", "src", "dst", "dst_dtype", "quant"}
        if unknown:
            raise ValueError(f"{what}.{sorted(unknown)[0]}: unknown key")
        for key in ("shape", "dtype", "src", "dst"):
            if key not in value:
                raise ValueError(f"{what}.{key}: missing; this key is required")
        return cls(
            value.get("name"),
            value["shape"],
            dtypes.to_dtype(value["dtype"], f"{what}.dtype"),
            Layout.from_json(value["src"], f"{what}.src"),
            Layout.from_json(value["dst"], f"{what}.dst"),
            dst_dtype=(
                dtypes.to_dtype(value["dst_dtype"], f"{what}.dst_dtype")
                if "dst_dtype" in value
                else None
            ),
            quant=Quant.from_json(value["quant"], f"{what}.quant") if "quant" in value else None,
        )

    def c_struct(
        self,
        version: int,
        index: int,
        src_offset: int = 0,
        dst_offset: int = 0,
        scale_offset: int = 0,
    ) -> Tuple[_lib.Tensor_t, List[object]]:
        """The C descriptor and what it points to (keep alive while it is used), with this
        rank's view offsets (and scale view offset) in a single-buffer call."""
        c = _lib.Tensor_t()
        c.size = ctypes.sizeof(_lib.Tensor_t)
        c.version = version
        c.ndim = len(self.shape)
        for i, n in enumerate(self.shape):
            c.shape[i] = n
        c.dtype = dtypes.nccl_code(self.dtype)
        c.srcOffset = src_offset
        c.dstOffset = dst_offset
        src, keep_src = self.src.c_struct(version, f"tensors[{index}].src")
        dst, keep_dst = self.dst.c_struct(version, f"tensors[{index}].dst")
        c.src = ctypes.pointer(src)
        c.dst = ctypes.pointer(dst)
        name = self.name.encode() if self.name else None
        c.name = name
        c.dstDtype = (
            dtypes.nccl_code(self.dst_dtype) if self.dst_dtype is not None else _lib.UNDEF_INT
        )
        c.scaleOffset = scale_offset
        keep: List[object] = [src, dst, keep_src, keep_dst, name]
        if self.quant is not None:
            quant, keep_quant = self.quant.c_struct(version, f"tensors[{index}].quant")
            c.quant = ctypes.addressof(quant)
            keep += [quant, keep_quant]
        return c, keep


@dataclass(frozen=True)
class Config:
    """Plan options; ``None`` leaves a field to the library's default.

    ``mode``: ``"auto"`` (default), ``"staged"`` or ``"groupable"`` (calls may sit inside
    ``ncclGroupStart/End``); ``ranks_per_node`` or ``node_of_rank`` (a node id per rank): the
    topology; ``split_min_bytes``: smallest part of a replicated overlap split across senders;
    ``rounds``: rounds the data is cut into (staged/auto); ``relay``: forward data several
    replicas on one node need over NVLink (staged/auto, topology known); ``sender_barrier``:
    a node's sending-only ranks enter each round together (``None``: where a node holds more
    than 8 of them; every such rank must then call the plan; docs/executor.md, "The senders'
    barrier"). A case file without a mode is run under every mode by ``ncclreshard check``.

    Failures (docs/resilience.md): ``timeout_ms``, the deadline of each call (0: none; ``None``:
    ``NCCL_RESHARD_TIMEOUT_MS``, else none), after which the call revokes the communicator and
    :func:`comm_wait` raises :class:`RemoteError`; not part of the fingerprint nor of case files.
    ``failed_ranks``: ranks of the communicator the layouts number that are gone; the plan is
    then the survivors' plan for the communicator :func:`comm_shrink` makes, and the plan's
    ``rank`` is this rank among the survivors. Every survivor passes the same list.
    """

    mode: Optional[str] = None
    ranks_per_node: Optional[int] = None
    node_of_rank: Optional[Tuple[int, ...]] = field(default=None)
    split_min_bytes: Optional[int] = None
    rounds: Optional[int] = None
    relay: Optional[bool] = None
    timeout_ms: Optional[int] = None
    failed_ranks: Optional[Tuple[int, ...]] = field(default=None)
    sender_barrier: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode is {self.mode!r}; expected one of {sorted(MODES)}")
        if self.ranks_per_node is not None and self.node_of_rank is not None:
            raise ValueError("Config: give either ranks_per_node or node_of_rank, not both")
        if self.ranks_per_node is not None:
            _index(self.ranks_per_node, "Config.ranks_per_node", 0)
        if self.node_of_rank is not None:
            object.__setattr__(
                self, "node_of_rank", _ints(self.node_of_rank, "Config.node_of_rank", 0)
            )
        if self.split_min_bytes is not None:
            _index(self.split_min_bytes, "Config.split_min_bytes", 0)
        if self.rounds is not None:
            _index(self.rounds, "Config.rounds", 0)
        if self.relay is not None and not isinstance(self.relay, bool):
            raise TypeError(f"Config.relay must be a bool, got {type(self.relay).__name__}")
        if self.sender_barrier is not None and not isinstance(self.sender_barrier, bool):
            raise TypeError(
                "Config.sender_barrier must be a bool, got "
                f"{type(self.sender_barrier).__name__}"
            )
        if self.timeout_ms is not None:
            _index(self.timeout_ms, "Config.timeout_ms", 0)
            if self.timeout_ms > 2**31 - 1:
                raise ValueError(f"Config.timeout_ms is {self.timeout_ms}; at most 2**31 - 1 ms")
        if self.failed_ranks is not None:
            failed = tuple(sorted(_ints(self.failed_ranks, "Config.failed_ranks", 0)))
            twice = [a for a, b in zip(failed, failed[1:]) if a == b]
            if twice:
                raise ValueError(f"Config.failed_ranks names rank {twice[0]} twice")
            object.__setattr__(self, "failed_ranks", failed or None)

    def survivor_of(self, rank: int) -> Optional[int]:
        """`rank` (of the communicator the layouts number) among the survivors, as
        ``ncclCommShrink`` renumbers: the rank less the failed ranks below it; None for a
        failed rank."""
        failed = self.failed_ranks or ()
        return None if rank in failed else rank - sum(1 for f in failed if f < rank)

    def original_of(self, survivor: int) -> int:
        """The rank the layouts number for rank `survivor` of the survivors (the inverse of
        :meth:`survivor_of`)."""
        rank = survivor
        for f in self.failed_ranks or ():  # sorted: each failed rank at or below moves it up
            if f <= rank:
                rank += 1
        return rank

    def to_json(self) -> dict:
        """The case-file config object (only the fields that are set)."""
        out: dict = {}
        for key in _CASE_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if key in ("node_of_rank", "failed_ranks") else value
        return out

    @classmethod
    def from_json(cls, value: Mapping[str, Any], what: str = "config") -> "Config":
        """A config from a case-file config object; errors name the key."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
        known = set(_CASE_KEYS)
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"{what}.{sorted(unknown)[0]}: unknown key")
        try:
            return cls(**{k: value[k] for k in known if k in value})
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}: {e}") from None

    def c_struct(self, version: int) -> Tuple[_lib.Config_t, List[object]]:
        """The C config (NCCL_RESHARD_CONFIG_INITIALIZER with the set fields)."""
        c = _lib.Config_t()
        c.size = ctypes.sizeof(_lib.Config_t)
        c.magic = _lib.CONFIG_MAGIC
        c.version = version
        c.mode = MODES[self.mode] if self.mode is not None else _lib.UNDEF_INT
        c.ranksPerNode = self.ranks_per_node if self.ranks_per_node is not None else _lib.UNDEF_INT
        keep: List[object] = []
        if self.node_of_rank is not None:
            table = (ctypes.c_int * max(1, len(self.node_of_rank)))(*self.node_of_rank)
            c.nodeOfRank = ctypes.cast(table, ctypes.POINTER(ctypes.c_int))
            c.nodeOfRankCount = len(self.node_of_rank)
            keep.append(table)
        c.splitMinBytes = self.split_min_bytes or 0
        c.maxStagingBytes = 0
        c.rounds = self.rounds if self.rounds is not None else _lib.UNDEF_INT
        c.relay = int(self.relay) if self.relay is not None else _lib.UNDEF_INT
        c.timeoutMs = self.timeout_ms if self.timeout_ms is not None else _lib.UNDEF_INT
        c.senderBarrier = (
            int(self.sender_barrier) if self.sender_barrier is not None else _lib.UNDEF_INT
        )
        if self.failed_ranks:
            failed = (ctypes.c_int * len(self.failed_ranks))(*self.failed_ranks)
            c.failedRanks = ctypes.cast(failed, ctypes.POINTER(ctypes.c_int))
            c.failedRankCount = len(self.failed_ranks)
            keep.append(failed)
        return c, keep


@dataclass(frozen=True)
class Case:
    """Tensors and a config: what every rank plans from, as one case of a case file."""

    tensors: Tuple[TensorSpec, ...]
    config: Config = Config()
    name: Optional[str] = None

    def __post_init__(self) -> None:
        tensors = tuple(self.tensors)
        if not tensors:
            raise ValueError("Case: tensors is empty; a plan needs at least one tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, TensorSpec):
                raise TypeError(f"Case: tensors[{i}] must be a TensorSpec, got {type(t).__name__}")
        if not isinstance(self.config, Config):
            raise TypeError(f"Case: config must be a Config, got {type(self.config).__name__}")
        object.__setattr__(self, "tensors", tensors)

    def to_json(self) -> dict:
        """The case object: one tensor as ``{"name"?, "shape", …, "config"?}`` (its name is the
        case's), several as ``{"name"?, "tensors": […], "config"?}``."""
        config = self.config.to_json()
        if len(self.tensors) == 1 and (self.name is None or self.tensors[0].name in (None, self.name)):
            out = self.tensors[0].to_json()
            if self.name is not None:
                out = {"name": self.name, **{k: v for k, v in out.items() if k != "name"}}
        else:
            out = {} if self.name is None else {"name": self.name}
            out["tensors"] = [t.to_json() for t in self.tensors]
        if config:
            out["config"] = config
        return out

    def dumps(self, **json_options: Any) -> str:
        """The case as JSON text (a case file ``ncclreshard check`` runs)."""
        return json.dumps(self.to_json(), **json_options)

    @classmethod
    def from_json(cls, value: Mapping[str, Any], what: str = "case") -> "Case":
        """A case from a case object; errors name the key."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
        config = Config.from_json(value["config"], f"{what}.config") if "config" in value else Config()
        if "tensors" in value:
            unknown = set(value) - {"name", "tensors", "config"}
            if unknown:
                raise ValueError(f"{what}.{sorted(unknown)[0]}: unknown key")
            tensors = [
                TensorSpec.from_json(t, f"{what}.tensors[{i}]")
                for i, t in enumerate(value["tensors"])
            ]
            return cls(tuple(tensors), config, value.get("name"))
        tensor = TensorSpec.from_json({k: v for k, v in value.items() if k != "config"}, what)
        return cls((tensor,), config, tensor.name)

    @classmethod
    def loads(cls, text: str) -> List["Case"]:
        """Every case of a case file's text (one case or an array of cases)."""
        value = json.loads(text)
        if isinstance(value, list):
            return [cls.from_json(v, f"case {i}") for i, v in enumerate(value)]
        return [cls.from_json(value)]
