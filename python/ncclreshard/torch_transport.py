"""A transport for plans that needs nothing but torch: :class:`TorchTransport` runs a plan's
exported transfers (:meth:`Plan.transfers`, ``ncclReshardPlanGetTransfers``) with
``torch.distributed`` point-to-point operations on any backend — gloo on CPU tensors, torch's
own NCCL on CUDA tensors — packing and unpacking with torch ops on byte views, and converting
(casts, FP8 quantization) with the library's arithmetic (docs/quantization.md) in torch ops.

What it runs is exactly what the header's ``ncclReshardTransfer_t`` says: round by round, a
transfer of round r starts once this rank's receives of earlier rounds are done; a pair's
transfers of one round travel as one message, in the order the plan lists them (the order both
ends list them in); conversions from the source view run before the first round, conversions
of received blocks after the last. The destination bytes are those ``ncclReshard`` leaves.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _lib
from .plan import Plan, TensorOrNone, Transfer, _dense
from .spec import Quant

# The sender's workspace views of converted tensors (ncclReshardView_t): the transport
# allocates them per call, as large as the plan's transfers reach.
_WORKSPACE = ("converted", "unconverted", "scales")
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The canonical NaN of each destination format (docs/quantization.md §2): torch keeps a NaN's
# sign and payload where it can, the library writes this one.
_CANONICAL_NAN = {
    torch.float8_e4m3fn: 0x7F,
    torch.float8_e5m2: 0x7F,
    torch.float16: 0x7E00,
    torch.bfloat16: 0x7FC0,
}
# 1e-4 rounded to FP32 (the library's AMAX_FLOOR), from its bits so that no double-to-float
# rounding can move it.
_AMAX_FLOOR_BITS = 0x38D1B717


def _timeout_ms(plan: Plan) -> int:
    """The plan's deadline: ``Config.timeout_ms``, else ``NCCL_RESHARD_TIMEOUT_MS``, else none
    (0), as the library reads it."""
    if plan.config.timeout_ms is not None:
        return plan.config.timeout_ms
    text = os.environ.get("NCCL_RESHARD_TIMEOUT_MS", "").strip()
    try:
        value = int(text) if text else 0
    except ValueError:
        raise ValueError(
            f"NCCL_RESHARD_TIMEOUT_MS is {text!r}; expected a number of milliseconds"
        ) from None
    return max(value, 0)


def _bytes_of(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """A uint8 tensor over `t`'s whole storage, and the byte of `t`'s first element in it: the
    plan addresses views in bytes from their first element, whatever their strides."""
    storage = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=t.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole, t.storage_offset() * t.element_size()


def _grid(base: torch.Tensor, offset: int, count: Sequence[int], strides: Sequence[int],
          chunk: int) -> torch.Tensor:
    """The bytes of a strided copy's side: `chunk` bytes at every point of the grid."""
    return base.as_strided(tuple(count) + (chunk,), tuple(strides) + (1,), offset)


def _is_dense(count: Sequence[int], strides: Sequence[int], chunk: int) -> bool:
    """True when the grid's chunks lie back to back in row-major order (one contiguous run)."""
    step = chunk
    for n, s in zip(reversed(count), reversed(strides)):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def _reach(offset: int, count: Sequence[int], strides: Sequence[int], last: int) -> int:
    """One past the last byte a grid touches (0 for an empty grid)."""
    if last == 0 or any(n == 0 for n in count):
        return 0
    return offset + sum((n - 1) * s for n, s in zip(count, strides)) + last


@dataclass(frozen=True)
class _Conversion:
    """What a converted tensor's convert transfers need: the block shape (elements per dim,
    relative to a box's first element: boxes hold whole blocks), the FP8 maximum, the scale
    encoding, and the index of its scale view (``ntensors + k``) or None for a cast."""

    block: Tuple[int, ...]
    scaled: bool
    e8m0: bool
    inverse: bool
    scale_slot: Optional[int]


class _Call:
    """One call's views: the caller's tensors and the workspace, as (uint8 base, byte offset)."""

    def __init__(self, views: Dict[Tuple[str, int], Tuple[torch.Tensor, int]]) -> None:
        self.views = views

    def get(self, view: str, tensor: int, what: str) -> Tuple[torch.Tensor, int]:
        found = self.views.get((view, tensor))
        if found is None:
            # The plan addresses a view the checks said this rank does not hold: a plan and
            # tensors that disagree, which check_tensors rules out.
            raise RuntimeError(f"{what}: the plan reads or writes the {view} view of tensor {tensor}, which this call lacks")
        return found


def _registered(group: Any) -> bool:
    """True when `group` is known to torch.distributed (the default group or one from
    ``dist.new_group``), False for a bare process group made outside it."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


class _Group:
    """The process group a call runs on, with one way to post a round's operations.

    A group torch.distributed knows (the default group, ``dist.new_group``) is used through
    ``dist.batch_isend_irecv`` with its members' global ranks. A bare one — a
    ``ProcessGroupGloo``/``ProcessGroupNCCL`` made on a store outside
    ``init_process_group``, as trainer and inference processes that each have their own
    default group must make to talk to each other — is used through its own ``send``/``recv``
    with its own ranks (on NCCL inside ``_start_coalescing``/``_end_coalescing``, as
    ``batch_isend_irecv`` does, so no send waits behind a receive)."""

    def __init__(self, group: Any) -> None:
        if group is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialised: call dist.init_process_group first, "
                    "or give the transport a process group (the transport runs on one)"
                )
            group = dist.group.WORLD
        self.group = group
        self.registered = _registered(group)
        if self.registered:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        elif all(callable(getattr(group, m, None)) for m in ("rank", "size", "send", "recv")):
            self.rank = int(group.rank())
            self.size = int(group.size())
            name = getattr(group, "name", None)
            self.backend = str(name() if callable(name) else "").lower()
        else:
            raise TypeError(
                f"group must be a torch.distributed process group, got {type(group).__name__}"
            )

    def post(self, ops: List[Tuple[str, torch.Tensor, int]], device: torch.device) -> List[Tuple[Any, int]]:
        """Posts one round's ``("send" | "recv", tensor, peer)`` operations: on NCCL as one
        batch (receives and sends together, so no send waits behind another's receive); on
        other backends, whose operations do not wait for each other, peer by peer, so that a
        peer found gone while posting (gloo raises at once on a closed connection) fails as
        that peer's work, when the call waits for it, not as the whole call's error. Returns
        (work, peer) pairs; a backend that coalesces the batch into one work names every peer
        for it."""
        if self.backend == "nccl":
            return self._post_batch(ops, device)
        works: List[Tuple[Any, int]] = []
        for peer in dict.fromkeys(p for _, _, p in ops):
            mine = [op for op in ops if op[2] == peer]
            try:
                works += self._post_batch(mine, device)
            except RuntimeError as e:  # torch's distributed errors are RuntimeErrors
                works.append((_FailedWork(e), peer))
        return works

    def _post_batch(self, ops: List[Tuple[str, torch.Tensor, int]], device: torch.device) -> List[Tuple[Any, int]]:
        """Posts `ops` as one batch (see :meth:`post`)."""
        peers = [peer for _, _, peer in ops]
        if self.registered:
            p2p = [
                dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor,
                           dist.get_global_rank(self.group, peer), self.group)
                for kind, tensor, peer in ops
            ]
            works = dist.batch_isend_irecv(p2p)
        elif self.backend == "nccl":
            self.group._start_coalescing(device)
            for kind, tensor, peer in ops:
                getattr(self.group, kind)([tensor], peer, 0)
            works = [self.group._end_coalescing(device)]
        else:
            works = [getattr(self.group, kind)([tensor], peer, 0) for kind, tensor, peer in ops]
        if len(works) == len(ops):
            return list(zip(works, peers))
        return [(w, p) for w in works for p in sorted(set(peers))]


class _FailedWork:
    """The work of operations that failed as they were posted: waiting for it raises what
    posting raised."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        raise self.error


class TorchTransport:
    """Runs `plan` with ``torch.distributed`` point-to-point operations on `group` (default: the
    default process group), whose ranks are the plan's ranks. Make it once per plan and call
    :meth:`reshard` every step: the schedule (rounds, messages, workspace sizes) is computed
    here, from :meth:`Plan.transfers`.

    `group` may also be a bare process group torch.distributed does not know: a
    ``ProcessGroupGloo``/``ProcessGroupNCCL`` made on a store, outside
    ``init_process_group``, which is how processes that each have a default group of their own
    (a trainer's, an inference engine's) make one over both; its own ranks are the plan's.

    Works on any backend that has ``isend``/``irecv``: gloo on CPU tensors (every rank a
    process, no GPU), torch's NCCL on CUDA tensors (the NCCL torch already loaded; nothing
    else in the process needs libnccl). Staging lives on the tensors' device.

    `check` waits for every peer's plan fingerprint (sent to each peer before the data, always)
    and raises when a peer planned something else, before any data moves; default: on CPU
    tensors, and on CUDA tensors when ``NCCL_RESHARD_CHECK=1`` (waiting there costs a host
    synchronisation).
    """

    def __init__(self, plan: Plan, group: Optional[Any] = None, *, check: Optional[bool] = None) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an ncclreshard.Plan, got {type(plan).__name__}")
        self.plan = plan
        self.group = group
        self.check = check
        self.rank = plan.rank
        n = len(plan.tensors)
        self._ntensors = n
        self._fingerprint = plan.fingerprint
        self._conversions: Dict[int, _Conversion] = {}
        self._scale_views = plan.scale_views()
        slots = {v.tensor: n + k for k, v in enumerate(self._scale_views)}
        for t, spec in enumerate(plan.tensors):
            if spec.dst_dtype is None:
                continue
            quant = spec.quant if spec.quant is not None else Quant("none")
            self._conversions[t] = _Conversion(
                block=quant.block_shape(spec.shape),
                scaled=t in slots,
                e8m0=quant.scale_format == "e8m0",
                inverse=quant.scale_inverse,
                scale_slot=slots.get(t),
            )

        transfers = [t for t in plan.transfers() if t.bytes > 0]
        self.rounds: List[int] = sorted({t.round for t in transfers})
        self._converts_before: Dict[int, List[Transfer]] = {}
        self._converts_after: Dict[int, List[Transfer]] = {}
        self._locals: Dict[int, List[Transfer]] = {}
        # round -> peer -> transfers in the plan's order (the order both ends list them in).
        self._sends: Dict[int, Dict[int, List[Transfer]]] = {}
        self._recvs: Dict[int, Dict[int, List[Transfer]]] = {}
        reach: Dict[Tuple[str, int], int] = {}

        def need(view: str, tensor: int, end: int) -> None:
            reach[(view, tensor)] = max(reach.get((view, tensor), 0), end)

        for t in transfers:
            if t.kind == "convert":
                conv = self._conversions.get(t.tensor)
                if conv is None:
                    raise ValueError(f"the plan converts tensor {t.tensor}, whose spec has no dst_dtype")
                ssize, dsize = t.src_dtype.itemsize, t.dst_dtype.itemsize
                need(t.src_view, t.tensor, _reach(t.src_offset, t.count, t.src_stride, ssize))
                need(t.dst_view, t.tensor, _reach(t.dst_offset, t.count, t.dst_stride, dsize))
                if conv.scaled:
                    grid = [-(-c // b) for c, b in zip(t.count, conv.block)]
                    size = 1 if conv.e8m0 else 4
                    need(t.scale_view, conv.scale_slot, _reach(t.scale_offset, grid, t.scale_stride, size))
                later = t.src_view == "unconverted"
                (self._converts_after if later else self._converts_before).setdefault(t.round, []).append(t)
                continue
            if t.kind in ("send", "local"):
                need(t.src_view, t.tensor, _reach(t.src_offset, t.count, t.src_stride, t.chunk_bytes))
            if t.kind in ("recv", "local"):
                need(t.dst_view, t.tensor, _reach(t.dst_offset, t.count, t.dst_stride, t.chunk_bytes))
            if t.kind == "local":
                self._locals.setdefault(t.round, []).append(t)
            elif t.kind == "send":
                self._sends.setdefault(t.round, {}).setdefault(t.peer, []).append(t)
            elif t.kind == "recv":
                self._recvs.setdefault(t.round, {}).setdefault(t.peer, []).append(t)
            else:
                raise ValueError(f"the plan holds a transfer of unknown kind {t.kind!r}")
        # The workspace as large as the transfers reach; the caller's views, checked against
        # their layouts on every call, must hold every byte the transfers address, so no call
        # can address memory outside them (or fail half way for want of a view).
        self._extents = {k: v for k, v in reach.items() if k[0] in _WORKSPACE}
        for (view, tensor), end in reach.items():
            if view in _WORKSPACE:
                continue
            held = self._view_extent(view, tensor)
            if held is None or end > held:
                raise RuntimeError(
                    f"rank {self.rank}: the plan's transfers address {end} bytes of the {view} "
                    f"view of tensor {tensor}, which this rank holds "
                    f"{'not at all' if held is None else f'with {held} bytes'}: the plan and "
                    "this package disagree (a bug: please report it)"
                )
        self.peers: Tuple[int, ...] = tuple(sorted(
            {p for r in self._sends.values() for p in r} | {p for r in self._recvs.values() for p in r}
        ))
        # Messages per call (without the fingerprints): one per peer pair and round.
        self.messages_sent = sum(len(r) for r in self._sends.values())
        self.messages_received = sum(len(r) for r in self._recvs.values())
        self.bytes_sent = sum(t.bytes for r in self._sends.values() for ts in r.values() for t in ts)
        self.bytes_received = sum(t.bytes for r in self._recvs.values() for ts in r.values() for t in ts)
        self._highest_rank = self._plan_ranks()

    # -- checks ---------------------------------------------------------------------------

    def _view_extent(self, view: str, tensor: int) -> Optional[int]:
        """Bytes from the first element of this rank's `view` of `tensor` to one past its last
        (None: the rank holds no such view), from the layout :meth:`check_tensors` enforces."""
        n = self._ntensors
        if view == "source" and tensor < n:
            spec = self.plan.tensors[tensor]
            shape, layout, dtype = self.plan.local_shape(tensor, "src"), spec.src, spec.dtype
        elif view == "destination" and tensor < n:
            spec = self.plan.tensors[tensor]
            shape, layout = self.plan.local_shape(tensor, "dst"), spec.dst
            dtype = spec.dst_dtype or spec.dtype
        elif view == "destination" and tensor - n < len(self._scale_views):
            scale = self._scale_views[tensor - n]
            shape, layout, dtype = scale.local_shape, scale.layout, scale.dtype
        else:
            return None
        if shape is None:
            return None
        if any(d == 0 for d in shape):
            return 0
        strides = layout.strides or _dense(shape)
        return (1 + sum((d - 1) * st for d, st in zip(shape, strides))) * dtype.itemsize

    def _plan_ranks(self) -> int:
        """The highest rank of the plan's communicator any layout names (survivors' numbering
        for a survivors' plan)."""
        config = self.plan.config
        highest = 0
        layouts = [l for s in self.plan.tensors for l in (s.src, s.dst)]
        layouts += [v.layout for v in self._scale_views]
        for layout in layouts:
            for r in layout.live_ranks:
                survivor = config.survivor_of(r)
                if survivor is not None:
                    highest = max(highest, survivor)
        return highest

    def _check_group(self, group: _Group) -> None:
        if group.rank < 0:
            raise ValueError("this process is not a member of the process group given")
        if group.rank != self.rank:
            raise ValueError(
                f"this process is rank {group.rank} of the process group but the plan is rank "
                f"{self.rank}'s; plan with the group's rank (Plan(specs, dist.get_rank(group)))"
            )
        if group.size <= self._highest_rank:
            raise ValueError(
                f"the process group has {group.size} ranks but the plan's layouts name rank "
                f"{self._highest_rank}; the plan's ranks are ranks of the group"
            )

    def check_tensors(
        self, src: Sequence[TensorOrNone], dst: Sequence[TensorOrNone], scales: Sequence[TensorOrNone] = ()
    ) -> Optional[torch.device]:
        """Checks every view against the plan as :meth:`Plan.check_views` does (dtype, local
        shape, strides, None where the rank holds no view, scale views), all on one device,
        CPU or CUDA, which it returns (None when the rank passes none). Raises
        ValueError/TypeError naming the view and what is wrong."""
        return self.plan.check_views(src, dst, scales, cuda=False)

    # -- the call -------------------------------------------------------------------------

    def reshard(
        self,
        src: Sequence[TensorOrNone],
        dst: Sequence[TensorOrNone],
        scales: Sequence[TensorOrNone] = (),
    ) -> None:
        """Runs the plan: reads this rank's source views `src` (one per plan tensor, None where
        it holds none), writes its destination views `dst` and, for quantized tensors, its
        scale views `scales` (float32, or uint8 for E8M0; one per quantized tensor) — the
        same per-tensor views :meth:`Plan.reshard` takes, so slices of fused parameters work.
        Source and destination views must not overlap.

        Every tensor, the process group and the devices are checked before anything is sent:
        ValueError/TypeError naming the tensor and what is wrong. A peer that planned something
        else raises NcclReshardError (with `check`). With a deadline (``Config.timeout_ms`` or
        ``NCCL_RESHARD_TIMEOUT_MS``), waits end by it and raise RemoteError naming the round
        and the peers still pending; then the destination views are undefined and the process
        group may hold unmatched operations (replace it, docs/resilience.md).

        On CUDA tensors the work is ordered on the current stream, as torch's collectives
        are; returns when it is enqueued (or done, with `check` or a deadline).
        """
        group = _Group(self.group)
        self._check_group(group)
        device = self.check_tensors(src, dst, scales)
        backend = group.backend
        if device is not None and device.type != "cuda" and backend == "nccl":
            raise ValueError(f"the process group's backend is NCCL but the tensors are on {device}; NCCL needs CUDA tensors")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        check = self.check
        if check is None:
            check = device.type != "cuda" or os.environ.get("NCCL_RESHARD_CHECK", "") == "1"
        timeout_ms = _timeout_ms(self.plan)
        with torch.no_grad():
            self._run(group, device, src, dst, scales, check, timeout_ms)

    def _run(self, group: _Group, device: torch.device, src: Sequence[TensorOrNone],
             dst: Sequence[TensorOrNone], scales: Sequence[TensorOrNone], check: bool,
             timeout_ms: int) -> None:
        n = self._ntensors
        views: Dict[Tuple[str, int], Tuple[torch.Tensor, int]] = {}
        for t in range(n):
            if src[t] is not None:
                views[("source", t)] = _bytes_of(src[t])
            if dst[t] is not None:
                views[("destination", t)] = _bytes_of(dst[t])
        for k, s in enumerate(scales):
            if s is not None:
                views[("destination", n + k)] = _bytes_of(s)
        for key, extent in self._extents.items():
            views[key] = (torch.empty(extent, dtype=torch.uint8, device=device), 0)
        call = _Call(views)
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else None
        stage_count = len(self.rounds)

        # Fingerprints first, one per peer each way, as the library's NCCL transport sends
        # them: a peer that planned something else is caught before any data moves (with
        # check; a peer without check may then have posted data no one receives), and
        # otherwise the two ends still post the same operations.
        fingerprint_works: List[Tuple[Any, int]] = []
        if self.peers:
            theirs = torch.zeros(len(self.peers), dtype=torch.int64, device=device)
            fp = self._fingerprint - (1 << 64) if self._fingerprint >= 1 << 63 else self._fingerprint
            mine = torch.full((1,), fp, dtype=torch.int64, device=device)
            ops = []
            for i, p in enumerate(self.peers):
                ops.append(("recv", theirs[i:i + 1], p))
                ops.append(("send", mine, p))
            fingerprint_works = group.post(ops, device)
            if check:
                stage = "the fingerprint exchange"
                self._wait(fingerprint_works, deadline, timeout_ms, stage)
                fingerprint_works = []
                for p, got in zip(self.peers, theirs.tolist()):
                    if got != fp:
                        theirs_u = got + (1 << 64) if got < 0 else got
                        raise _lib.NcclReshardError(
                            "TorchTransport.reshard", _lib.INVALID_USAGE,
                            f"rank {p} created its plan from different tensors or config than "
                            f"rank {self.rank} (fingerprint {theirs_u:#018x} vs "
                            f"{self._fingerprint:#018x}); every rank must pass the same specs "
                            "and config",
                        )

        for index, r in enumerate(self.rounds):
            for t in self._converts_before.get(r, ()):
                self._convert(t, call)
            for t in self._locals.get(r, ()):
                s_base, s_off = call.get(t.src_view, t.tensor, "local copy")
                d_base, d_off = call.get(t.dst_view, t.tensor, "local copy")
                _grid(d_base, d_off + t.dst_offset, t.count, t.dst_stride, t.chunk_bytes).copy_(
                    _grid(s_base, s_off + t.src_offset, t.count, t.src_stride, t.chunk_bytes)
                )
            ops, unpacks = [], []
            for p, ts in self._recvs.get(r, {}).items():
                buffer, unpack = self._receive_buffer(ts, call, device)
                ops.append(("recv", buffer, p))
                if unpack:
                    unpacks.append((ts, buffer))
            for p, ts in self._sends.get(r, {}).items():
                ops.append(("send", self._send_buffer(ts, call, device), p))
            if ops:
                works = group.post(ops, device)
                if index == 0 and fingerprint_works:
                    works = fingerprint_works + works
                    fingerprint_works = []
                stage = f"round {r} (the rank's {index + 1} of {stage_count})"
                self._wait(works, deadline, timeout_ms, stage)
            for ts, buffer in unpacks:
                position = 0
                for t in ts:
                    d_base, d_off = call.get(t.dst_view, t.tensor, "receive")
                    piece = buffer[position:position + t.bytes].view(tuple(t.count) + (t.chunk_bytes,))
                    _grid(d_base, d_off + t.dst_offset, t.count, t.dst_stride, t.chunk_bytes).copy_(piece)
                    position += t.bytes
            for t in self._converts_after.get(r, ()):
                self._convert(t, call)
        if fingerprint_works:
            self._wait(fingerprint_works, deadline, timeout_ms, "the fingerprint exchange")

    def _wait(self, works: List[Tuple[Any, int]], deadline: Optional[float], timeout_ms: int,
              stage: str) -> None:
        """Waits for every work, by the deadline when there is one; raises RemoteError naming
        the stage and the peers whose operations had not completed."""
        pending: List[int] = []
        causes: List[str] = []
        for work, peer in works:
            try:
                if deadline is None:
                    done = work.wait()
                else:
                    # A work found late still gets a moment: it may have completed already.
                    left = max(deadline - time.monotonic(), 0.001)
                    done = work.wait(timeout=timedelta(seconds=left))
                if done is False:
                    raise TimeoutError("the wait timed out")
            except Exception as e:  # torch raises backend-specific types for one failure
                if peer not in pending:
                    pending.append(peer)
                first = (str(e).splitlines() or [""])[0]
                cause = f"{type(e).__name__}: {first[:300]}"
                if cause not in causes and len(causes) < 2:
                    causes.append(cause)
        if not pending:
            return
        if deadline is not None and time.monotonic() >= deadline:
            what = (
                f"had not completed within its deadline of {timeout_ms} ms (Config.timeout_ms, "
                "NCCL_RESHARD_TIMEOUT_MS)"
            )
        else:
            what = "failed"
        raise _lib.RemoteError(
            "TorchTransport.reshard", _lib.REMOTE_ERROR,
            f"rank {self.rank}: {stage} with peers {sorted(pending)} {what}; torch said: "
            f"{' | '.join(causes)}. The destination views of this call are undefined and the "
            "process group may hold unmatched operations: agree on the failed ranks, make a "
            "group of the survivors, plan with Config(failed_ranks=...) and call again "
            "(docs/resilience.md)",
        )

    def _send_buffer(self, ts: List[Transfer], call: _Call, device: torch.device) -> torch.Tensor:
        """One message to a peer: the transfers' bytes in order, packed; a lone transfer whose
        bytes lie back to back in its view goes as it is."""
        if len(ts) == 1 and _is_dense(ts[0].count, ts[0].src_stride, ts[0].chunk_bytes):
            t = ts[0]
            base, off = call.get(t.src_view, t.tensor, "send")
            return base[off + t.src_offset:off + t.src_offset + t.bytes]
        buffer = torch.empty(sum(t.bytes for t in ts), dtype=torch.uint8, device=device)
        position = 0
        for t in ts:
            base, off = call.get(t.src_view, t.tensor, "send")
            buffer[position:position + t.bytes].view(tuple(t.count) + (t.chunk_bytes,)).copy_(
                _grid(base, off + t.src_offset, t.count, t.src_stride, t.chunk_bytes)
            )
            position += t.bytes
        return buffer

    def _receive_buffer(self, ts: List[Transfer], call: _Call, device: torch.device) -> Tuple[torch.Tensor, bool]:
        """Where a peer's message lands: its destination bytes when it is one transfer whose
        bytes lie back to back there (no unpack), else staging to unpack (True)."""
        if len(ts) == 1 and _is_dense(ts[0].count, ts[0].dst_stride, ts[0].chunk_bytes):
            t = ts[0]
            base, off = call.get(t.dst_view, t.tensor, "receive")
            return base[off + t.dst_offset:off + t.dst_offset + t.bytes], False
        return torch.empty(sum(t.bytes for t in ts), dtype=torch.uint8, device=device), True

    # -- conversions (docs/quantization.md) -----------------------------------------------

    def _convert(self, t: Transfer, call: _Call) -> None:
        """A convert transfer: the box's elements read as FP32, each block's scale from its
        amax, every element divided by its block's scale (scaled schemes) and stored in the
        destination format; the scales written at their offsets."""
        conv = self._conversions[t.tensor]
        count = tuple(t.count)
        if any(c == 0 for c in count):
            return
        s_base, s_off = call.get(t.src_view, t.tensor, "conversion")
        d_base, d_off = call.get(t.dst_view, t.tensor, "conversion")
        src_dtype, dst_dtype = t.src_dtype, t.dst_dtype
        x = (
            _grid(s_base, s_off + t.src_offset, count, t.src_stride, src_dtype.itemsize)
            .view(src_dtype)[..., 0]
            .to(torch.float32)  # exact: bfloat16 and float16 widen exactly
        )
        if conv.scaled:
            y, stored = self._quantize(x, conv, dst_dtype)
            grid = tuple(-(-c // b) for c, b in zip(count, conv.block))
            scale_base, scale_off = call.get(t.scale_view, conv.scale_slot, "scales")
            _grid(scale_base, scale_off + t.scale_offset, grid, t.scale_stride, stored.shape[-1]).copy_(stored)
        else:
            y = x
        _grid(d_base, d_off + t.dst_offset, count, t.dst_stride, dst_dtype.itemsize).copy_(_encode(y, dst_dtype))

    @staticmethod
    def _quantize(x: torch.Tensor, conv: _Conversion, dst_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(x divided by its blocks' scales, the stored scales as bytes: grid + (1 or 4,))."""
        count = tuple(x.shape)
        block = conv.block
        grid = tuple(-(-c // b) for c, b in zip(count, block))
        padded = tuple(g * b for g, b in zip(grid, block))
        # Trailing blocks are short: pad them with zeros, which no amax (≥ 0) notices.
        if padded == count:
            xp = x
        else:
            xp = x.new_zeros(padded)
            xp[tuple(slice(0, c) for c in count)] = x
        # (g0, b0, g1, b1, ...): each block's elements along the odd dims.
        split = tuple(v for g, b in zip(grid, block) for v in (g, b))
        magnitude = torch.where(torch.isnan(xp), torch.zeros_like(xp), xp.abs())
        amax = magnitude.reshape(split).amax(dim=tuple(range(1, 2 * len(count), 2))) if count else magnitude
        # Every operand a tensor on the device: CUDA turns a division by a host scalar into a
        # multiplication by its reciprocal, which is not the IEEE division the library does.
        floor = torch.full_like(amax, _AMAX_FLOOR_BITS, dtype=torch.int32).view(torch.float32)
        fmax = torch.full_like(amax, _FP8_MAX[dst_dtype])
        s = torch.maximum(amax, floor) / fmax
        if conv.e8m0:
            # s ≥ 1e-4 / 57344 is a normal FP32 number below 2^120 (or an infinity): its
            # exponent plus one when any mantissa bit is set is the power of two at or above.
            bits = s.view(torch.int32)
            exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
            infinite = torch.isinf(s)
            divisor = torch.where(infinite, s, (exponent << 23).view(torch.float32))
            code = 254 - exponent if conv.inverse else exponent
            stored = torch.where(infinite, torch.full_like(code, 0xFF), code).to(torch.uint8)
            stored = stored.reshape(grid + (1,))
        else:
            divisor = s
            value = torch.ones_like(s) / s if conv.inverse else s
            stored = value.reshape(grid + (1,)).view(torch.uint8)
        shaped = divisor.reshape(tuple(v for g in grid for v in (g, 1))) if count else divisor
        y = (xp.reshape(split) / shaped).reshape(padded) if count else xp / shaped
        return y[tuple(slice(0, c) for c in count)], stored


def _encode(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 values as `dtype` bytes (shape + (itemsize,)): round to nearest even; FP8 saturating
    at its largest finite value (torch's ``.to(float8)`` is not: clamp first, which rounds the
    same since rounding is monotonic and the maximum is representable); bfloat16/float16 to
    infinity past their range, as torch; NaN the format's canonical NaN."""
    nan = torch.isnan(y)
    if dtype in _FP8_MAX:
        limit = _FP8_MAX[dtype]
        codes = y.clamp(-limit, limit).to(dtype).view(torch.uint8)
        codes = torch.where(nan, torch.full_like(codes, _CANONICAL_NAN[dtype]), codes)
        return codes.reshape(tuple(y.shape) + (1,))
    if dtype in (torch.bfloat16, torch.float16):
        codes = y.to(dtype).view(torch.int16)
        codes = torch.where(nan, torch.full_like(codes, _CANONICAL_NAN[dtype]), codes)
        return codes.reshape(tuple(y.shape) + (1,)).view(torch.uint8)
    raise ValueError(f"{dtype} is not a conversion target")


__all__ = ["TorchTransport"]
