"""The worker side of the ``ncclreshard`` weight-transfer backend: a vLLM
``WeightTransferEngine`` that writes every checkpoint byte straight into the live model's
parameters (fused ``qkv_proj``/``gate_up_proj``/``w13``/``w2`` included) through views, with
no full-tensor fallback and no ``load_weights``.

vLLM creates it in each worker (``WeightTransferEngineFactory.create_engine``) once
``ncclreshard.vllm.register`` has registered it (the ``vllm.general_plugins`` entry point of
``pip install ncclreshard``) and ``weight_transfer_config={"backend": "ncclreshard"}`` is set;
the trainer's :class:`~ncclreshard.vllm.trainer.NcclReshardTrainerEngine` drives it through
vLLM's control plane (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Set

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .layouts import ModelPieces, destination_pieces
from .session import TRANSPORTS, Session
from .specs import Declaration, Refit, RefitError

logger = logging.getLogger("ncclreshard.vllm")


def _positive_int(value: Any, what: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int of at least {minimum}, got {value!r}")


@dataclass(kw_only=True)
class NcclReshardInitInfo(WeightTransferInitInfo):
    """What each worker needs to join the refit group (JSON-safe: vLLM's HTTP control plane
    carries it unchanged; the trainer engine builds it, ``worker_init_info()``).

    `master_address`/`master_port`: the store trainer rank 0 hosts; `rank_offset`: the number
    of trainer ranks (workers follow them: ``rank_offset + dp_index * (TP * PP) + rank``);
    `world_size`: trainer ranks plus workers; `transport`: ``"torch"`` (torch.distributed, any
    backend; `torch_backend` gloo/nccl, default by the model's device) or ``"nccl"`` (the
    library's executor); `timeout_ms`: each transfer's deadline; `mode`, `ranks_per_node`: the
    plans' options; `store_timeout_s`: how long a rank waits for the others' declarations and
    verdicts."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    transport: str = "torch"
    torch_backend: Optional[str] = None
    timeout_ms: Optional[int] = None
    mode: Optional[str] = None
    ranks_per_node: Optional[int] = None
    store_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address must name the host of trainer rank 0's store")
        _positive_int(self.master_port, "master_port", 1)
        _positive_int(self.rank_offset, "rank_offset (the number of trainer ranks)", 1)
        _positive_int(self.world_size, "world_size", self.rank_offset + 1)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport is {self.transport!r}; expected one of {list(TRANSPORTS)}")
        if self.torch_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"torch_backend is {self.torch_backend!r}; expected 'gloo', 'nccl' or None")
        if self.timeout_ms is not None:
            _positive_int(self.timeout_ms, "timeout_ms", 0)


@dataclass
class NcclReshardUpdateInfo(WeightTransferUpdateInfo):
    """One update: the declaration `epoch` the trainer sends in (a new one after its tensors'
    shapes or layouts changed), the checkpoint `names` it sends now (None: all declared) and
    the trainer's update count `step` (every rank's key for agreeing on this update)."""

    epoch: int = 0
    names: Optional[List[str]] = field(default=None)
    step: int = 0


class NcclReshardWeightTransferEngine(WeightTransferEngine[NcclReshardInitInfo, NcclReshardUpdateInfo]):
    """Receives refits into the live model. At init it derives where every checkpoint byte
    lands in this worker's parameters (:func:`~ncclreshard.vllm.layouts.destination_pieces`),
    joins the refit group, exchanges declarations with the trainers and every other worker
    and plans; each update checks its views with every rank, zeroes the vocabulary padding
    rows and receives in place. Every error names the checkpoint tensor and the vLLM
    parameter and is raised on every rank before anything is sent."""

    init_info_cls = NcclReshardInitInfo
    update_info_cls = NcclReshardUpdateInfo
    # The destinations are derived from the model this engine was made for.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: Optional[Session] = None
        self.group_rank: Optional[int] = None
        self._pieces: Optional[ModelPieces] = None
        self._epoch = -1
        self._refit: Optional[Refit] = None
        self._received: Set[str] = set()
        self.last_transfer_s = 0.0

    # -- vLLM's engine API --------------------------------------------------------------------

    def init_transfer_engine(self, init_info: NcclReshardInitInfo) -> None:
        if self.session is not None:
            raise RuntimeError(
                "the ncclreshard weight transfer is already initialized; call "
                "shutdown_weight_transfer_engine() first"
            )
        parallel = self.parallel_config
        workers = parallel.data_parallel_size * parallel.world_size
        if init_info.world_size != init_info.rank_offset + workers:
            raise ValueError(
                f"init_info.world_size is {init_info.world_size} but {init_info.rank_offset} "
                f"trainer ranks and {workers} vLLM workers (DP {parallel.data_parallel_size} x "
                f"TP*PP {parallel.world_size}) make {init_info.rank_offset + workers}"
            )
        if parallel.pipeline_parallel_size != 1:
            raise ValueError("the ncclreshard backend supports pipeline-parallel size 1 only")
        rank = (init_info.rank_offset + getattr(parallel, "data_parallel_index", 0) * parallel.world_size
                + parallel.rank)
        error: Optional[str] = None
        try:
            self._pieces = destination_pieces(self.model, self.vllm_config)
        except RefitError as e:
            error = str(e)
        session = Session(
            address=init_info.master_address, port=init_info.master_port, rank=rank,
            world_size=init_info.world_size, device=self.device, transport=init_info.transport,
            torch_backend=init_info.torch_backend, timeout_ms=init_info.timeout_ms,
            mode=init_info.mode, ranks_per_node=init_info.ranks_per_node,
            store_timeout_s=init_info.store_timeout_s,
        )
        self.group_rank = rank
        try:
            self._declare(session, 0, error)
            assert self._refit is not None
            session.plan(0, self._refit)
        except BaseException:
            session.close()
            raise
        self.session = session

    def start_weight_update(self) -> None:
        self._check_initialized()
        self._received = set()

    def update_weights(self, update_info: Any) -> None:
        # vLLM's own version ends with torch.accelerator.synchronize(), which raises on a
        # machine without the accelerator its torch was built for (a CPU worker with the CUDA
        # wheel); the transports return with the data in place on CPU, so only CUDA syncs.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: NcclReshardUpdateInfo) -> None:
        session = self._check_initialized()
        if update_info.epoch != self._epoch:
            self._declare(session, update_info.epoch, None)
        assert self._refit is not None and self._pieces is not None
        refit = self._refit.subset(update_info.names)
        rank = self.group_rank
        params = self._pieces.params

        def view(piece: Any, shape: Any) -> torch.Tensor:
            flat = params[piece.param].data.view(-1)
            return flat[piece.offset:piece.offset + piece.numel].view(shape)

        def views(plan: Any) -> Any:
            dst = []
            for i, held in enumerate(refit.pieces):
                piece = held.get(rank)
                dst.append(None if piece is None else view(piece, plan.local_shape(i, "dst")))
            # One scale view per quantized tensor, in tensor order (FP8 block scales).
            scales = []
            for s in plan.scale_views():
                piece = refit.scales[s.tensor].get(rank)
                scales.append(None if piece is None else view(piece, s.local_shape))
            return [None] * len(dst), dst, scales

        touched = {held[rank].param for held in refit.pieces if rank in held}

        def zero_padding() -> None:
            for param, offset, count in self._pieces.zeros:
                if param in touched:
                    params[param].data.view(-1)[offset:offset + count].zero_()

        start = time.perf_counter()
        with torch.no_grad():
            self.last_transfer_s = session.run(self._epoch, update_info.step, refit, views,
                                              before=zero_padding)
        self._received.update(refit.names)
        logger.info("ncclreshard: rank %d received %d tensors in %.3f s (transfer %.3f s)",
                    rank, len(refit.specs), time.perf_counter() - start, self.last_transfer_s)

    def finish_weight_update(self) -> None:
        self._check_initialized()
        assert self._refit is not None
        missing = [n for n in self._refit.names if n not in self._received]
        if missing:
            held = {n: p for n, h in zip(self._refit.names, self._refit.pieces) for p in h.values()}
            raise RefitError(
                f"this weight update sent {len(self._received)} of {len(self._refit.names)} "
                f"declared tensors; {missing[0]!r} (vLLM's {held[missing[0]].param}) and "
                f"{len(missing) - 1} more were not updated"
            )

    def shutdown(self) -> None:
        session, self.session = self.session, None
        self._refit, self._epoch = None, -1
        if session is not None:
            session.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_initialized(self) -> Session:
        if self.session is None:
            raise RuntimeError(
                "ncclreshard weight transfer not initialized: call init_weight_transfer_engine first"
            )
        return self.session

    def _declare(self, session: Session, epoch: int, error: Optional[str]) -> None:
        pieces = self._pieces.pieces if self._pieces is not None and error is None else ()
        assert self.group_rank is not None
        self._refit = session.declare(
            epoch, Declaration(self.group_rank, "worker", pieces=pieces, error=error)
        )
        self._epoch = epoch
        counted = sum(p.numel * p.dtype.itemsize for p in pieces)
        logger.info("ncclreshard: rank %d declared %d pieces (%d bytes) for epoch %d",
                    self.group_rank, len(pieces), counted, epoch)


__all__ = ["NcclReshardInitInfo", "NcclReshardUpdateInfo", "NcclReshardWeightTransferEngine"]
