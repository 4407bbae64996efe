"""Plans: :class:`Plan` (one rank's ``ncclReshardPlan_t``), what it does (:class:`PlanInfo`,
:class:`Transfer`), the call (:meth:`Plan.reshard`) and a cache of plans (:class:`PlanCache`)."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _lib, dtypes
from .comm import comm_handle as _comm_handle
from .layout import Layout, local_shape
from .spec import MODES, Case, Config, TensorSpec

_MODE_NAMES = {v: k for k, v in MODES.items()}
_TRANSFER_KINDS = {0: "send", 1: "recv", 2: "local", 3: "convert"}
# ncclReshardView_t.
_VIEWS = {0: "source", 1: "destination", 2: "converted", 3: "unconverted", 4: "scales"}


@dataclass(frozen=True)
class PlanInfo:
    """What a plan does on its rank (``ncclReshardPlanGetInfo``). ``fingerprint`` is equal on
    all ranks iff they planned from the same specs and config; ``send_bytes``/``recv_bytes``
    are the bytes of this rank's source/destination buffers the plan touches."""

    rank: int
    ntensors: int
    mode: str
    groupable: bool
    peers: int
    messages_sent: int
    messages_received: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    staging_bytes: int
    fingerprint: int
    send_bytes: int
    recv_bytes: int
    rounds: int
    # Tensors with scales (their scale views follow the tensors' in ``reshard(scales=…)``)
    # and the conversion workspace a call allocates (docs/quantization.md).
    scale_tensors: int = 0
    work_bytes: int = 0


@dataclass(frozen=True)
class Transfer:
    """One strided byte copy of the plan (``ncclReshardTransfer_t``; its doc in
    ``ncclReshard.h`` has the geometry, the execution rule and how sends match receives).

    ``kind`` is ``"send"``, ``"recv"``, ``"local"`` or ``"convert"`` (a box of a tensor cast or
    quantized on this rank, docs/quantization.md); ``src_view`` is ``"source"`` or
    ``"destination"`` (a forward of relayed data), or for converted tensors ``"converted"``,
    ``"unconverted"`` or ``"scales"`` (workspace views), ``dst_view`` the view written;
    ``src_dtype``/``dst_dtype`` the element types read and written. ``chunk_bytes`` contiguous bytes at every
    point of the ``count`` grid: read at ``src_offset + Σ i[k]·src_stride[k]`` of the sender's
    view of ``tensor``, written at ``dst_offset + Σ i[k]·dst_stride[k]`` of the receiver's
    destination view; a transfer of ``round`` r may start once this rank's receives of earlier
    rounds are done.

    A ``"convert"`` transfer converts the box of ``count`` elements (``src_stride`` and
    ``dst_stride`` between elements, in bytes) and writes the scale of each of its blocks at
    ``scale_offset + Σ b[k]·scale_stride[k]`` of ``scale_view`` (``"scales"`` on a sender,
    ``"destination"``, the rank's scale view, on a receiver); other transfers leave the three
    ``scale_*`` fields at their defaults."""

    kind: str
    peer: int
    tensor: int
    global_start: Tuple[int, ...]
    global_count: Tuple[int, ...]
    src_offset: int
    dst_offset: int
    chunk_bytes: int
    count: Tuple[int, ...]
    src_stride: Tuple[int, ...]
    dst_stride: Tuple[int, ...]
    bytes: int
    round: int
    src_view: str
    block_offset: int
    block_bytes: int
    dst_view: str = "destination"
    src_dtype: Optional[torch.dtype] = None
    dst_dtype: Optional[torch.dtype] = None
    scale_view: str = "destination"
    scale_offset: int = 0
    scale_stride: Tuple[int, ...] = ()


@dataclass(frozen=True)
class ScaleView:
    """The scales of one quantized tensor (docs/quantization.md): the plan's tensor `tensor`,
    the global scale tensor's `shape` and `layout` (``Quant.scale_layout``, else the tensor's
    destination mesh and placements, dense), the `dtype` of scale views (float32, or uint8
    for E8M0) and this rank's `local_shape` of them (None: it holds none)."""

    tensor: int
    shape: Tuple[int, ...]
    layout: Layout
    dtype: torch.dtype
    local_shape: Optional[Tuple[int, ...]]


TensorOrNone = Optional[torch.Tensor]


def _one_device(present: Sequence[Tuple[str, torch.Tensor]], cuda: bool) -> Optional[torch.device]:
    """The one device of the named tensors (None for none), checked after every view fits the
    plan, so a tensor that does not fit is named before a device mix-up."""
    device: Optional[torch.device] = None
    first = ""
    for what, tensor in present:
        if cuda and tensor.device.type != "cuda":
            raise ValueError(f"{what}: on {tensor.device}; reshard needs CUDA tensors")
        if device is None:
            device, first = tensor.device, what
        elif tensor.device != device:
            raise ValueError(f"{what}: on {tensor.device} but {first} is on {device}")
    return device


def _dense(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _stream_handle(stream: Any, device: Optional[torch.device]) -> Tuple[int, Any]:
    """(cudaStream_t, the torch stream or None)."""
    if stream is None:
        if device is None or device.type != "cuda":
            return 0, None
        current = torch.cuda.current_stream(device)
        return current.cuda_stream, current
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream), stream
    if isinstance(stream, ctypes.c_void_p):
        return stream.value or 0, None
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream, None
    raise TypeError(f"stream must be a torch.cuda.Stream, a cudaStream_t or None, got {stream!r}")


class Plan:
    """This rank's reshard plan for `tensors` (``ncclReshardPlanCreate``): computed locally,
    with no communication; every rank must pass the same specs and config. Immutable; usable
    from several threads on different streams. ``close()`` (or leaving a ``with`` block)
    destroys it: work it enqueued must be complete by then.

    With ``config.failed_ranks`` the plan is the survivors' plan (docs/resilience.md): `rank`
    is this rank among the survivors (its rank in the communicator :func:`comm_shrink` made),
    while the specs keep numbering ranks as before the failure; :attr:`original_rank` is this
    rank in that numbering, the one views are cut for (``recipe.src_views(shards,
    plan.original_rank)``).

    Raises ValueError/TypeError for a bad spec (the library's message names the tensor and
    field, e.g. ``tensors[2].src->placements[1].dim is 3…``), NcclReshardError for plans the
    limits refuse (staging bound, groupable message cap) and for a survivors' plan no survivor
    can serve (``ncclInvalidUsage``: "no surviving rank holds …", the same on every survivor).
    """

    def __init__(
        self,
        tensors: Union[Sequence[TensorSpec], Case],
        rank: int,
        config: Optional[Config] = None,
    ) -> None:
        if isinstance(tensors, Case):
            case = tensors if config is None else Case(tensors.tensors, config, tensors.name)
        else:
            case = Case(tuple(tensors), config if config is not None else Config())
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self.case = case
        self.rank = rank
        self.original_rank = case.config.original_of(rank)
        self._handle: Optional[int] = None
        self._lock = threading.Lock()
        # The local shapes every call checks its tensors against (None: no view on that side).
        self._shapes = [
            (self._local(t.src, t, i, "src"), self._local(t.dst, t, i, "dst"))
            for i, t in enumerate(case.tensors)
        ]
        self._scale_views: Optional[Tuple[ScaleView, ...]] = None
        library = _lib.lib()
        version = library.struct_version
        keep: List[object] = []
        array = (_lib.Tensor_t * len(case.tensors))()
        offsets = self._offsets()
        for i, t in enumerate(case.tensors):
            array[i], k = t.c_struct(version, i, *offsets[i])
            keep.append(k)
        config_c, k = case.config.c_struct(version)
        keep.append(k)
        handle = ctypes.c_void_p()
        library.call(
            "ncclReshardPlanCreate", ctypes.byref(handle), len(case.tensors), array, rank,
            ctypes.byref(config_c),
        )
        self._handle = handle.value
        self._info = self._read_info()

    def _offsets(self) -> List[Tuple[int, int]]:
        """Each tensor's views packed one after another in a single buffer per side (the
        library requires views that do not overlap there, though ``ncclReshardMulti`` takes a
        pointer per tensor and ignores the offsets)."""
        ends = [0, 0]
        out = []
        for i, spec in enumerate(self.case.tensors):
            pair = []
            for side, (shape, layout) in enumerate(zip(self._shapes[i], (spec.src, spec.dst))):
                start = -(-ends[side] // 64) * 64
                extent = 0
                dtype = spec.dst_dtype if side == 1 and spec.dst_dtype is not None else spec.dtype
                if shape is not None and all(shape):
                    strides = layout.strides or _dense(shape)
                    extent = (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * dtype.itemsize
                pair.append(start)
                ends[side] = start + extent
            out.append((pair[0], pair[1]))
        return out

    def _local(
        self, layout: Layout, spec: TensorSpec, index: int, side: str
    ) -> Optional[Tuple[int, ...]]:
        if self.original_rank not in layout.ranks:
            return None
        try:
            return local_shape(layout, spec.shape, self.original_rank)
        except _lib.NcclReshardError as e:
            raise type(e)(e.function, e.code, f"{spec.label(index)}.{side}: {e.message}") from None

    @property
    def tensors(self) -> Tuple[TensorSpec, ...]:
        return self.case.tensors

    @property
    def config(self) -> Config:
        return self.case.config

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _live(self) -> int:
        handle = self._handle
        if handle is None:
            raise ValueError(
                f"the plan of rank {self.rank} ({len(self.tensors)} tensors) is closed"
            )
        return handle

    def _read_info(self) -> PlanInfo:
        c = _lib.PlanInfo_t()
        c.size = ctypes.sizeof(_lib.PlanInfo_t)
        c.version = _lib.lib().struct_version
        _lib.lib().call("ncclReshardPlanGetInfo", self._live(), ctypes.byref(c))
        return PlanInfo(
            rank=c.rank, ntensors=c.ntensors, mode=_MODE_NAMES.get(c.mode, str(c.mode)),
            groupable=bool(c.groupable), peers=c.peers, messages_sent=c.messagesSent,
            messages_received=c.messagesReceived, bytes_sent=c.bytesSent,
            bytes_received=c.bytesReceived, bytes_copied=c.bytesCopied,
            staging_bytes=c.stagingBytes, fingerprint=c.fingerprint, send_bytes=c.sendBytes,
            recv_bytes=c.recvBytes, rounds=c.rounds, scale_tensors=c.scaleTensors,
            work_bytes=c.workBytes,
        )

    @property
    def info(self) -> PlanInfo:
        """What the plan does on this rank; ValueError once closed."""
        self._live()
        return self._info

    @property
    def fingerprint(self) -> int:
        """Equal on all ranks iff they planned the same thing; ValueError once closed."""
        return self.info.fingerprint

    def local_shape(self, tensor: int, side: str) -> Optional[Tuple[int, ...]]:
        """This rank's local shape of tensor `tensor` on `side` (``"src"`` or ``"dst"``), None
        when the rank holds no view there."""
        src, dst = self._shapes[tensor]
        return {"src": src, "dst": dst}[side]

    def scale_views(self) -> List[ScaleView]:
        """One entry per quantized tensor, in the order ``reshard(scales=…)`` takes their
        views: what this rank's scale view of each must be (to allocate them). Worked out once
        per plan: every call checks its scale views against it."""
        if self._scale_views is None:
            out = []
            for i, spec in enumerate(self.tensors):
                quant = spec.quant
                if quant is None or quant.scheme == "none":
                    continue
                layout = quant.scale_layout or Layout(spec.dst.mesh_shape, spec.dst.ranks, spec.dst.placements)
                shape = quant.scale_shape(spec.shape)
                held = self.original_rank in layout.ranks
                out.append(ScaleView(
                    i, shape, layout, quant.scale_dtype,
                    local_shape(layout, shape, self.original_rank) if held else None,
                ))
            self._scale_views = tuple(out)
        return list(self._scale_views)

    def check_scales(self, scales: Sequence[TensorOrNone]) -> List[Tuple[str, torch.Tensor]]:
        """Checks the scale views against the plan (one per quantized tensor, None where the
        rank holds none; dtype, local shape and strides as :meth:`scale_views` says) and
        returns the present ones with their names. Raises ValueError/TypeError naming the
        view and what is wrong."""
        views = self.scale_views()
        if isinstance(scales, torch.Tensor) or not hasattr(scales, "__len__"):
            raise TypeError(f"scales must be a sequence of {len(views)} tensors or None")
        if len(scales) != len(views):
            raise ValueError(
                f"scales has {len(scales)} entries; the plan has {len(views)} quantized tensors"
            )
        present = []
        for k, (given, view) in enumerate(zip(scales, views)):
            what = f"scales[{k}] (of {self.tensors[view.tensor].label(view.tensor)})"
            dtypes = [view.dtype]
            if view.dtype == torch.uint8 and hasattr(torch, "float8_e8m0fnu"):
                dtypes.append(torch.float8_e8m0fnu)  # E8M0's own dtype, where torch has it
            if self._check_view(
                given, what, view.local_shape, view.layout, dtypes, "the scales' mesh", "a scale view"
            ):
                present.append((what, given))
        return present

    def transfers(self) -> List[Transfer]:
        """Every byte this rank sends, receives or copies, as strided copies with their rounds
        (``ncclReshardPlanGetTransfers``): enough for another transport to run the plan."""
        library = _lib.lib()
        handle = self._live()
        count = ctypes.c_int()
        library.call("ncclReshardPlanGetTransfers", handle, None, 0, ctypes.byref(count))
        array = (_lib.Transfer_t * max(1, count.value))()
        array[0].size = ctypes.sizeof(_lib.Transfer_t)
        array[0].version = library.struct_version
        library.call(
            "ncclReshardPlanGetTransfers", handle, array, count.value, ctypes.byref(count)
        )
        out = []
        for c in array[: count.value]:
            n, k = c.ndim, c.copyNdim
            out.append(Transfer(
                kind=_TRANSFER_KINDS.get(c.kind, str(c.kind)), peer=c.peer, tensor=c.tensor,
                global_start=tuple(c.globalStart[:n]), global_count=tuple(c.globalCount[:n]),
                src_offset=c.srcOffset, dst_offset=c.dstOffset, chunk_bytes=c.chunkBytes,
                count=tuple(c.count[:k]), src_stride=tuple(c.srcStride[:k]),
                dst_stride=tuple(c.dstStride[:k]), bytes=c.bytes, round=c.round,
                src_view=_VIEWS.get(c.srcView, str(c.srcView)),
                block_offset=c.blockOffset, block_bytes=c.blockBytes,
                dst_view=_VIEWS.get(c.dstView, str(c.dstView)),
                src_dtype=dtypes.from_nccl_code(c.srcDtype),
                dst_dtype=dtypes.from_nccl_code(c.dstDtype),
                scale_view=_VIEWS.get(c.scaleView, str(c.scaleView)),
                scale_offset=c.scaleOffset,
                scale_stride=tuple(c.scaleStride[:k]) if c.kind == 3 else (),
            ))
        return out

    def check_tensors(
        self, src: Sequence[TensorOrNone], dst: Sequence[TensorOrNone], *, devices: bool = True
    ) -> Optional[torch.device]:
        """Checks every tensor against the plan (what a call does before any NCCL call) and
        returns their device (None when the rank passes none).

        A tensor is expected where the rank holds a view of that tensor on that side and must
        be None elsewhere; it must have the spec's dtype, this rank's local shape, the layout's
        strides (dense row-major when the layout has none), and be on one CUDA device with
        the others (not checked with ``devices=False``, for views of memory torch does not
        own). Raises ValueError (TypeError for a non-tensor) naming the tensor and field.
        """
        present = self._check_tensor_views(src, dst)
        return _one_device(present, cuda=True) if devices else None

    def check_views(
        self, src: Sequence[TensorOrNone], dst: Sequence[TensorOrNone],
        scales: Sequence[TensorOrNone] = (), *, cuda: bool = True,
    ) -> Optional[torch.device]:
        """:meth:`check_tensors` and :meth:`check_scales` together: every view, then one device
        for all (a CUDA device unless `cuda` is False), which it returns (None when the rank
        passes none). Raises ValueError/TypeError naming the view and what is wrong."""
        present = self._check_tensor_views(src, dst) + self.check_scales(scales)
        return _one_device(present, cuda)

    def _check_tensor_views(
        self, src: Sequence[TensorOrNone], dst: Sequence[TensorOrNone]
    ) -> List[Tuple[str, torch.Tensor]]:
        self._live()
        n = len(self.tensors)
        for side, entries in (("src", src), ("dst", dst)):
            if isinstance(entries, torch.Tensor) or not hasattr(entries, "__len__"):
                raise TypeError(f"{side} must be a sequence of {n} tensors or None, one per plan tensor")
            if len(entries) != n:
                raise ValueError(f"{side} has {len(entries)} entries; the plan has {n} tensors")
        present: List[Tuple[str, torch.Tensor]] = []
        for i, spec in enumerate(self.tensors):
            for side, given, layout in (("src", src[i], spec.src), ("dst", dst[i], spec.dst)):
                what = f"{side}[{i}] ({spec.name!r})" if spec.name else f"{side}[{i}]"
                want = spec.dst_dtype if side == "dst" and spec.dst_dtype is not None else spec.dtype
                if self._check_view(
                    given, what, self.local_shape(i, side), layout, [want],
                    f"this tensor's {side} mesh", f"a {side} view",
                ):
                    present.append((what, given))
        return present

    def _check_view(
        self, given: Any, what: str, expected: Optional[Tuple[int, ...]], layout: Layout,
        dtypes: Sequence[torch.dtype], mesh: str, held: str,
    ) -> bool:
        """One view against the plan: None exactly where the rank holds none (`expected` is
        None), else a tensor of one of `dtypes`, this rank's local shape and the layout's
        strides. True when the view is present."""
        if expected is None:
            if given is not None:
                raise ValueError(
                    f"{what}: rank {self.original_rank} is not in {mesh} {list(layout.ranks)}; pass None"
                )
            return False
        if given is None:
            raise ValueError(
                f"{what} is None but rank {self.original_rank} holds {held} of shape {list(expected)}"
            )
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor or None, got {type(given).__name__}")
        if given.dtype not in dtypes:
            raise ValueError(
                f"{what}: dtype is {given.dtype}; the plan says {' or '.join(str(d) for d in dtypes)}"
            )
        if tuple(given.shape) != expected:
            raise ValueError(
                f"{what}: shape is {list(given.shape)}; rank {self.original_rank}'s local shape "
                f"is {list(expected)}"
            )
        self._check_strides(given, layout, what)
        return True

    @staticmethod
    def _check_strides(tensor: torch.Tensor, layout: Layout, what: str) -> None:
        if tensor.numel() == 0:
            return
        sized = [d for d in range(tensor.dim()) if tensor.shape[d] > 1]
        if layout.strides is None:
            if not tensor.is_contiguous():
                raise ValueError(
                    f"{what}: not contiguous (strides {list(tensor.stride())}); the plan's "
                    "layout is dense row-major: pass .contiguous() or give the layout strides"
                )
            return
        if any(tensor.stride(d) != layout.strides[d] for d in sized):
            raise ValueError(
                f"{what}: strides are {list(tensor.stride())}; the plan's layout says "
                f"{list(layout.strides)}"
            )

    def _scale_entries(self, scales: Sequence[Any]) -> List[Any]:
        """`scales` as a list, one entry per scale tensor of the plan."""
        expected = self.info.scale_tensors
        if isinstance(scales, torch.Tensor) or not hasattr(scales, "__len__"):
            raise TypeError(f"scales must be a sequence of {expected} entries")
        if len(scales) != expected:
            raise ValueError(
                f"scales has {len(scales)} entries; the plan has {expected} quantized tensors"
            )
        return list(scales)

    def reshard(
        self,
        src: Sequence[TensorOrNone],
        dst: Sequence[TensorOrNone],
        comm: Any,
        stream: Any = None,
        scales: Sequence[TensorOrNone] = (),
    ) -> None:
        """Reshards every tensor of the plan (``ncclReshardMulti``): reads this rank's source
        views `src` (one per plan tensor, None where it holds none) and writes its destination
        views `dst`, on `stream` (default: ``torch.cuda.current_stream()`` of the tensors'
        device). Stream-ordered and asynchronous, like an NCCL collective: the destination is
        complete when the stream reaches this point; sources must not change until then.
        A plan with quantized tensors also writes their scales: `scales` holds one view per
        such tensor (``info.scale_tensors``, in tensor order; None where this rank holds none).

        Checks every view first (:meth:`check_views`): nothing reaches NCCL when one is
        wrong. Raises ValueError/TypeError for a wrong tensor, comm or stream, ValueError for a
        closed plan, NcclReshardError for what the library refuses or NCCL/CUDA failures.
        """
        device = self.check_views(src, dst, scales)
        scales = list(scales)
        handle = _comm_handle(comm)
        stream_handle, torch_stream = _stream_handle(stream, device)
        n = len(self.tensors)
        sends = (ctypes.c_void_p * n)(*[t.data_ptr() if t is not None else None for t in src])
        views = list(dst) + list(scales)
        recvs = (ctypes.c_void_p * len(views))(
            *[t.data_ptr() if t is not None else None for t in views]
        )
        with self._lock:  # closing waits for a call in progress on another thread
            plan = self._live()
            _lib.lib().call("ncclReshardMulti", sends, recvs, plan, handle, stream_handle)
        if stream is not None and torch_stream is not None and device is not None:
            # The caching allocator must not reuse these tensors' memory before the stream
            # reaches the reshard.
            if torch_stream != torch.cuda.current_stream(device):
                for t in list(src) + views:
                    if t is not None:
                        t.record_stream(torch_stream)

    def reshard_pointers(
        self,
        src: Sequence[Optional[int]],
        dst: Sequence[Optional[int]],
        comm: Any,
        stream: Any = 0,
        scales: Sequence[Optional[int]] = (),
    ) -> None:
        """:meth:`reshard` on raw device pointers (one per plan tensor, None where the rank holds
        no view), for memory torch does not own; nothing but their presence is checked here
        (check views with ``check_tensors(..., devices=False)`` first). `stream` is a
        ``cudaStream_t`` (0: the legacy default stream). Errors as :meth:`reshard`."""
        n = len(self.tensors)
        for side, pointers in (("src", src), ("dst", dst)):
            if len(pointers) != n:
                raise ValueError(f"{side} has {len(pointers)} entries; the plan has {n} tensors")
        scales = self._scale_entries(scales)
        handle = _comm_handle(comm)
        stream_handle, _ = _stream_handle(stream, None)
        sends = (ctypes.c_void_p * n)(*src)
        views = list(dst) + list(scales)
        recvs = (ctypes.c_void_p * len(views))(*views)
        with self._lock:
            plan = self._live()
            _lib.lib().call("ncclReshardMulti", sends, recvs, plan, handle, stream_handle)

    def close(self) -> None:
        """Destroys the plan (``ncclReshardPlanDestroy``); a no-op once closed. Work it
        enqueued must have completed (synchronize its streams first)."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            _lib.lib().call("ncclReshardPlanDestroy", handle)

    def __enter__(self) -> "Plan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fingerprint={self._info.fingerprint:#x}"
        return f"Plan(rank={self.rank}, tensors={len(self.tensors)}, {state})"


class PlanCache:
    """Plans reused across steps: :meth:`get` returns the plan already made for the same specs,
    config and rank, and :meth:`by_fingerprint` finds a plan by the fingerprint a peer reports.
    Plans live until :meth:`clear` (nothing is evicted behind the caller's back: a plan must
    not be destroyed while its work may still run)."""

    def __init__(self) -> None:
        self._plans: Dict[Tuple[str, Optional[int], int], Plan] = {}
        self._by_fingerprint: Dict[int, Plan] = {}
        self._lock = threading.Lock()

    def get(
        self,
        tensors: Union[Sequence[TensorSpec], Case],
        rank: int,
        config: Optional[Config] = None,
    ) -> Plan:
        """The plan for these specs on `rank`, made on first use. Errors as :class:`Plan`."""
        if isinstance(tensors, Case):
            case = tensors if config is None else Case(tensors.tensors, config, tensors.name)
        else:
            case = Case(tuple(tensors), config if config is not None else Config())
        # The deadline is not part of a case; plans with different deadlines are different.
        key = (case.dumps(sort_keys=True), case.config.timeout_ms, rank)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None or plan.closed:
                plan = Plan(case, rank)
                self._plans[key] = plan
                self._by_fingerprint[plan.fingerprint] = plan
            return plan

    def by_fingerprint(self, fingerprint: int) -> Optional[Plan]:
        """The cached open plan with this fingerprint, or None."""
        with self._lock:
            plan = self._by_fingerprint.get(fingerprint)
            return plan if plan is not None and not plan.closed else None

    def __len__(self) -> int:
        return sum(1 for p in self._plans.values() if not p.closed)

    def clear(self) -> None:
        """Closes and forgets every plan (their work must have completed)."""
        with self._lock:
            plans = list(self._plans.values())
            self._plans.clear()
            self._by_fingerprint.clear()
        for plan in plans:
            plan.close()
