"""The trainer side of the ``ncclreshard`` weight-transfer backend: a vLLM
``TrainerWeightTransferEngine`` (registered in ``WeightTransferTrainerFactory`` when this
module is imported) and the sources it reads the trainer's weights from.

Every trainer rank calls ``WeightTransferTrainerFactory.trainer_init(init_info, client=...,
source=...)`` and then ``send_weights()`` once per refit; rank 0 alone drives vLLM's control
plane (``client``), every rank sends its own shards. A source says, per Hugging Face
checkpoint tensor, its global shape, dtype and layout over the trainer ranks, and gives this
rank's local view of it:

- :class:`DTensorSource`: FSDP2 / FSDP2 + TP parameters (any DTensor, ``_StridedShard``
  included: :meth:`~ncclreshard.Layout.from_dtensor`), plain tensors replicated;
- :class:`TensorSource`: explicit :class:`TrainerTensor` entries (Megatron-style layouts: the
  recipes' source layouts and views, :func:`recipe_tensors`);
- any vLLM ``WeightSource`` (its ``metadata`` owners, mesh and ``Shard``/``Replicate``
  placements, and ``iter_local()``).

Plans are made once per declaration: ``send_weights`` re-declares (a new epoch, re-planned on
every rank) only when the source's shapes, dtypes or layouts changed.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from ..layout import Layout, RankMap
from ..placements import Replicate, Shard
from .session import TRANSPORTS, Session
from .specs import Declaration, Refit, RefitError, SourceTensor

logger = logging.getLogger("ncclreshard.vllm")

from . import BACKEND


# -- sources --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerTensor:
    """One checkpoint tensor as the trainer holds it: Hugging Face `name`, global `shape` (dim 0
    may be split in two, ``[groups, rows_per_group, …]``, for interleaved views), `dtype`, its
    `layout` over refit-group ranks (with `strides` when views are strided) and `view`: this
    rank's local view (a tensor, or a function of no arguments returning it, evaluated at every
    send; None where the rank holds none)."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    view: Union[torch.Tensor, Callable[[], Optional[torch.Tensor]], None]

    def local(self) -> Optional[torch.Tensor]:
        return self.view() if callable(self.view) else self.view


class TrainerSource:
    """What the trainer engine reads: :meth:`tensors` (the declaration, the same on every
    trainer rank) and :meth:`views` (this rank's local views by name, at send time)."""

    def tensors(self, trainer_ranks: int) -> List[SourceTensor]:
        raise NotImplementedError

    def views(self, rank: int) -> Dict[str, Optional[torch.Tensor]]:
        raise NotImplementedError


class TensorSource(TrainerSource):
    """Explicit :class:`TrainerTensor` entries, in the order given."""

    def __init__(self, tensors: Iterable[TrainerTensor]) -> None:
        self._tensors = list(tensors)
        names = [t.name for t in self._tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{next(n for n in names if names.count(n) > 1)!r} is given twice")

    def tensors(self, trainer_ranks: int) -> List[SourceTensor]:
        return [SourceTensor(t.name, tuple(t.shape), t.dtype, t.layout) for t in self._tensors]

    def views(self, rank: int) -> Dict[str, Optional[torch.Tensor]]:
        return {t.name: (t.local() if rank in t.layout.ranks else None) for t in self._tensors}


class DTensorSource(TrainerSource):
    """Parameters by Hugging Face name (a module's ``named_parameters()``, a mapping or pairs):
    a DTensor (FSDP2, FSDP2 + TP, any mesh and placements but ``Partial``) is sent from its
    shards as they lie (``Layout.from_dtensor``; `rank_map` turns torch ranks of its mesh into
    refit-group ranks, default the same), a plain tensor from every trainer rank (replicated).
    `name_map` renames (e.g. strips a wrapper's prefix); a name it maps to None is not sent."""

    def __init__(
        self,
        params: Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
        rank_map: Optional[RankMap] = None,
        name_map: Optional[Callable[[str], Optional[str]]] = None,
    ) -> None:
        # A module is read afresh at every send: a trainer may replace its parameters (a new
        # sharding), which then makes a new declaration and plan.
        self._module = params if isinstance(params, torch.nn.Module) else None
        self._fixed = None if self._module is not None else (
            list(params.items()) if isinstance(params, Mapping) else list(params)
        )
        self._name_map = name_map
        self._rank_map = rank_map

    @property
    def _params(self) -> List[Tuple[str, torch.Tensor]]:
        pairs = list(self._module.named_parameters()) if self._module is not None else self._fixed
        out = []
        for name, p in pairs or []:
            mapped = self._name_map(name) if self._name_map is not None else name
            if mapped is not None:
                out.append((mapped, p))
        return out

    def tensors(self, trainer_ranks: int) -> List[SourceTensor]:
        out = []
        for name, p in self._params:
            if hasattr(p, "device_mesh") and hasattr(p, "placements"):
                layout = Layout.from_dtensor(p, self._rank_map)
            else:
                layout = Layout([trainer_ranks], 0, [Replicate()])
            out.append(SourceTensor(name, tuple(p.shape), p.dtype, layout))
        return out

    def views(self, rank: int) -> Dict[str, Optional[torch.Tensor]]:
        out: Dict[str, Optional[torch.Tensor]] = {}
        for name, p in self._params:
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = local.detach()
        return out


class WeightSourceAdapter(TrainerSource):
    """A vLLM ``WeightSource``: ``metadata`` declares each parameter (owners, mesh shape,
    ``Shard``/``Replicate`` placements; none: replicated on every trainer rank) and
    ``iter_local()`` yields this rank's pieces. `rank_map` maps its trainer ranks to
    refit-group ranks (default the same)."""

    def __init__(self, source: WeightSource, rank_map: Optional[RankMap] = None) -> None:
        self.source = source
        self._rank_map = rank_map

    def _rank(self, r: int) -> int:
        m = self._rank_map
        if m is None:
            return r
        return int(m(r) if callable(m) else m[r])  # type: ignore[index]

    def tensors(self, trainer_ranks: int) -> List[SourceTensor]:
        out = []
        for meta in self.source.metadata:
            owners = meta.owners if meta.owners is not None else tuple(range(trainer_ranks))
            mesh = meta.mesh_shape or (len(owners),)
            places: List[Any] = []
            for p in meta.placements or [None] * len(mesh):
                places.append(Shard(p.dim) if p is not None and hasattr(p, "dim") else Replicate())
            layout = Layout(mesh, [self._rank(r) for r in owners], places)
            out.append(SourceTensor(meta.name, tuple(meta.shape), meta.dtype, layout))
        return out

    def views(self, rank: int) -> Dict[str, Optional[torch.Tensor]]:
        return {name: t.detach() for name, t in self.source.iter_local()}


def recipe_tensors(recipe: Any, names: Mapping[str, str], params: Mapping[str, torch.Tensor],
                   rank: int) -> List[TrainerTensor]:
    """The source side of a fused-parameter recipe (:mod:`ncclreshard.recipes`, e.g.
    ``megatron_qkv_to_vllm``) as trainer tensors: each piece's global shape, source layout and
    this rank's view of `params` (the trainer's local parameters), under the Hugging Face name
    `names` gives the piece (``{"qkv_proj.q": "model.layers.0.self_attn.q_proj.weight"}``). The
    recipe's destination side is not used: the workers derive theirs from the live model."""
    out = []
    for piece in recipe.pieces:
        spec = piece.spec
        if spec.name not in names:
            raise ValueError(f"recipe piece {spec.name!r} has no Hugging Face name in `names`")
        view = piece.src

        def local(view: Any = view, layout: Layout = spec.src) -> Optional[torch.Tensor]:
            if rank not in layout.ranks:
                return None
            held = params[view.param]
            held = held.to_local() if hasattr(held, "to_local") else held
            return view.take(held, rank)

        out.append(TrainerTensor(names[spec.name], spec.shape, spec.dtype, spec.src, local))
    return out


def _join(future: Optional[Future], executor: Optional[ThreadPoolExecutor],
          failure: Optional[BaseException]) -> Optional[BaseException]:
    """Waits for a control-plane RPC run beside the transfer and returns the first failure:
    `failure` (this rank's), else the RPC's."""
    try:
        if future is not None:
            try:
                future.result()
            except BaseException as e:
                if failure is None:
                    return e
                if hasattr(failure, "add_note"):
                    failure.add_note(f"the workers' RPC failed too: {type(e).__name__}: {e}")
        return failure
    finally:
        if executor is not None:
            executor.shutdown(wait=False)


def _as_source(source: Any) -> TrainerSource:
    if isinstance(source, TrainerSource):
        return source
    if isinstance(source, WeightSource):
        return WeightSourceAdapter(source)
    if isinstance(source, torch.nn.Module):
        return DTensorSource(source)
    raise TypeError(
        "source must be an ncclreshard.vllm.trainer TrainerSource (DTensorSource, TensorSource), "
        f"a vLLM WeightSource or a torch module, got {type(source).__name__}"
    )


# -- the engine -----------------------------------------------------------------------------


@dataclass(kw_only=True)
class NcclReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info (every trainer rank, `rank` its rank in the refit group, 0 the
    one that drives vLLM's control plane and hosts the store at `master_address`:
    `master_port`). `num_trainer_ranks` trainers and the vLLM workers make `world_size`
    ranks; the other fields are the worker's (:class:`~ncclreshard.vllm.worker.
    NcclReshardInitInfo`)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    num_trainer_ranks: int
    world_size: int
    transport: str = "torch"
    torch_backend: Optional[str] = None
    timeout_ms: Optional[int] = None
    mode: Optional[str] = None
    ranks_per_node: Optional[int] = None
    store_timeout_s: float = 600.0
    device: Optional[str] = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport is {self.transport!r}; expected one of {list(TRANSPORTS)}")
        if not 0 <= self.rank < self.num_trainer_ranks < self.world_size:
            raise ValueError(
                f"rank {self.rank}, num_trainer_ranks {self.num_trainer_ranks} and world_size "
                f"{self.world_size} must satisfy 0 <= rank < num_trainer_ranks < world_size"
            )

    def worker_init_info(self) -> Dict[str, Any]:
        """The dict for ``client.init_weight_transfer_engine`` (the workers' init info)."""
        out = {k: v for k, v in asdict(self).items()
               if k not in ("rank", "num_trainer_ranks", "device")}
        out["rank_offset"] = self.num_trainer_ranks
        return {k: v for k, v in out.items() if v is not None}


class NcclReshardTrainerEngine(TrainerWeightTransferEngine[NcclReshardTrainerInitInfo]):
    """Sends the trainer's shards straight into the vLLM workers' parameters (see the module
    doc). Every trainer rank runs :meth:`trainer_init` and :meth:`send_weights`; rank 0 also
    calls the client, the worker RPCs that block while data flows from a helper thread."""

    init_info_cls = NcclReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True, rank: int = 0) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.session: Optional[Session] = None
        self.trainer_ranks = 0
        self._source: Optional[TrainerSource] = None
        self._declared: Optional[List[SourceTensor]] = None
        self._refit: Optional[Refit] = None
        self.epoch = -1
        self._round = 0
        self.last_transfer_s = 0.0

    @classmethod
    def trainer_init(cls, init_info: NcclReshardTrainerInitInfo, *, client: Any, source: Any = None) -> "NcclReshardTrainerEngine":
        if source is None:
            raise ValueError("the ncclreshard trainer engine needs a source of the trainer's weights")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        engine._source = _as_source(source)
        engine.trainer_ranks = init_info.num_trainer_ranks
        error: Optional[str] = None
        declared: List[SourceTensor] = []
        try:
            declared = engine._source.tensors(engine.trainer_ranks)
        except (ValueError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
        executor: Optional[ThreadPoolExecutor] = None
        init: Optional[Future] = None
        if engine.is_sender:
            # The workers join the group inside this RPC, so it must run while we do.
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclreshard-init")
            init = executor.submit(client.init_weight_transfer_engine, init_info.worker_init_info())
        failure: Optional[BaseException] = None
        try:
            device = torch.device(init_info.device or ("cuda" if init_info.transport == "nccl" else "cpu"))
            engine.session = Session(
                address=init_info.master_address, port=init_info.master_port, rank=init_info.rank,
                world_size=init_info.world_size, device=device, transport=init_info.transport,
                torch_backend=init_info.torch_backend, timeout_ms=init_info.timeout_ms,
                mode=init_info.mode, ranks_per_node=init_info.ranks_per_node,
                store_timeout_s=init_info.store_timeout_s,
            )
            engine._declare(declared, error)
        except BaseException as e:
            failure = e
        # The workers fail where we do (the same declarations, the same verdicts), so their
        # RPC returns too; its error is reported when ours is not the first.
        failure = _join(init, executor, failure)
        if failure is not None:
            engine.shutdown()
            raise failure
        return engine

    def _declare(self, declared: List[SourceTensor], error: Optional[str]) -> None:
        assert self.session is not None
        self.epoch += 1
        self._refit = self.session.declare(
            self.epoch, Declaration(self.rank, "trainer", sources=tuple(declared), error=error)
        )
        self._declared = declared
        self.session.plan(self.epoch, self._refit)

    def send_weights(self, names: Optional[Sequence[str]] = None) -> None:
        """One refit round: every declared tensor (or those `names`) goes straight to where
        the workers' parameters hold it. Re-declares first (a new epoch, planned once) when the
        source's shapes, dtypes or layouts changed. Raises what any rank refused (RefitError
        naming the tensor and vLLM parameter) before anything is sent."""
        if self.session is None or self._source is None or self._refit is None:
            raise RuntimeError("the ncclreshard trainer engine is not initialized (trainer_init)")
        declared = self._source.tensors(self.trainer_ranks)
        changed = declared != self._declared
        epoch = self.epoch + 1 if changed else self.epoch
        names = None if names is None else list(names)
        executor: Optional[ThreadPoolExecutor] = None
        update: Optional[Future] = None
        error: Optional[str] = None
        begin = f"begin/{self._round}"
        if self.is_sender:
            try:
                self.client.start_weight_update()
                executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclreshard-update")
                update = executor.submit(self.client.update_weights,
                                         {"epoch": epoch, "names": names, "step": self._round})
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            # The other trainer ranks must not wait on workers that never got the update.
            self.session.publish(begin, error)
        else:
            error = self.session.read(begin, 0, "the start of the update")
        failure: Optional[BaseException] = None
        if error is not None:
            failure = RefitError(f"the weight update could not start on the workers: {error}")
        else:
            try:
                if changed:
                    self._declare(declared, None)
                refit = self._refit.subset(names)
                views = self._source.views(self.rank)

                def pick(plan: Any) -> Any:
                    src = [views.get(s.name) if self.rank in s.src.ranks else None for s in refit.specs]
                    return src, [None] * len(refit.specs), [None] * plan.info.scale_tensors

                self.last_transfer_s = self.session.run(self.epoch, self._round, refit, pick)
            except BaseException as e:
                failure = e
        failure = _join(update, executor, failure)
        if failure is None and self.is_sender:
            try:
                self.client.finish_weight_update()
            except BaseException as e:
                failure = e
        self._outcome(failure)

    def _outcome(self, failure: Optional[BaseException]) -> None:
        """Rank 0 tells the other trainer ranks how the round ended on the workers; every rank
        raises its own failure, or rank 0's."""
        assert self.session is not None
        key = f"outcome/{self._round}"
        self._round += 1
        if self.is_sender:
            text = None if failure is None else f"{type(failure).__name__}: {failure}"
            self.session.publish(key, text)
            if failure is not None:
                raise failure
            return
        if failure is not None:
            raise failure
        text = self.session.read(key, 0, "the round's outcome")
        if text is not None:
            raise RefitError(f"the weight update failed (trainer rank 0): {text}")

    def shutdown(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


# The trainer process need not run vLLM's plugins: importing this module registers the engine
# (once: the factory refuses a second registration of the name).
try:
    WeightTransferTrainerFactory.register_engine(BACKEND, NcclReshardTrainerEngine)
except ValueError:
    pass

__all__ = [
    "BACKEND",
    "DTensorSource",
    "NcclReshardTrainerEngine",
    "NcclReshardTrainerInitInfo",
    "TensorSource",
    "TrainerSource",
    "TrainerTensor",
    "WeightSourceAdapter",
    "recipe_tensors",
]
