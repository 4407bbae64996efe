"""The refit group of trainer ranks and vLLM workers, as both sides of the backend use it.

A ``torch.distributed`` ``TCPStore`` (hosted by trainer rank 0 at the init info's address and
port) carries the small things: every rank's declaration (:mod:`~ncclreshard.vllm.specs`),
the plans' fingerprints, and before every update each rank's verdict on its own views, so
that a bad tensor on one rank stops every rank before anything is sent. The data goes
through the transport the init info names:

- ``"torch"``: :class:`~ncclreshard.TorchTransport` on a bare process group made on the same
  store (gloo for CPU tensors, torch's NCCL for CUDA ones); what the CPU tests run;
- ``"nccl"``: the library's own executor (:meth:`~ncclreshard.Plan.reshard`) on an NCCL
  communicator made with :func:`~ncclreshard.init_comm` over the store (CUDA only).

Group ranks: trainers ``[0, T)``, workers ``[T, world_size)``. Plans are made once per
(declaration epoch, tensor subset) and reused by every update.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import zlib
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..plan import Plan
from ..spec import Config
from .specs import Declaration, Refit, RefitError, build

logger = logging.getLogger("ncclreshard.vllm")

TRANSPORTS = ("torch", "nccl")


class Session:
    """One rank's membership of the refit group. Collective: every rank of the group makes
    its Session with the same address, port and world size (trainer rank 0 first hosts the
    store; the others wait for it up to `store_timeout_s`).

    `device` is where this rank's tensors live (CPU or CUDA); `torch_backend` the process
    group's backend for the torch transport (default: gloo on CPU, nccl on CUDA);
    `timeout_ms` each transfer's deadline (``Config.timeout_ms``); `mode` and
    `ranks_per_node` the plans' options."""

    def __init__(
        self,
        *,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        transport: str = "torch",
        torch_backend: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        mode: Optional[str] = None,
        ranks_per_node: Optional[int] = None,
        store_timeout_s: float = 600.0,
    ) -> None:
        import torch.distributed as dist

        if transport not in TRANSPORTS:
            raise ValueError(f"transport is {transport!r}; expected one of {list(TRANSPORTS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in the refit group of {world_size} ranks")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.transport = transport
        self.config = Config(mode=mode, ranks_per_node=ranks_per_node, timeout_ms=timeout_ms)
        self.timeout_s = store_timeout_s
        self._store = dist.TCPStore(
            address, port, world_size, rank == 0, timeout=timedelta(seconds=store_timeout_s),
            wait_for_workers=False,
        )
        self.store = dist.PrefixStore("ncclreshard/vllm", self._store)
        self.group: Any = None
        self.comm: Any = None
        if transport == "torch":
            backend = torch_backend or ("nccl" if self.device.type == "cuda" else "gloo")
            group_store = dist.PrefixStore("group", self.store)
            timeout = timedelta(seconds=store_timeout_s)
            if backend == "gloo":
                self.group = dist.ProcessGroupGloo(group_store, rank, world_size, timeout)
            elif backend == "nccl":
                if self.device.index is not None:
                    torch.cuda.set_device(self.device)
                self.group = dist.ProcessGroupNCCL(group_store, rank, world_size, timeout)
                connect = getattr(self.group, "eager_connect_single_device", None)
                if callable(connect):  # every rank joins now, not at its first send
                    connect(self.device)
            else:
                raise ValueError(f"torch_backend is {backend!r}; expected 'gloo' or 'nccl'")
        else:
            if self.device.type != "cuda":
                raise ValueError(
                    f"the 'nccl' transport (the library's executor) needs CUDA tensors; this "
                    f"rank's are on {self.device}: use transport 'torch'"
                )
            from ..comm import init_comm

            self.comm = init_comm(world_size, rank, dist.PrefixStore("comm", self.store), self.device)
        self._plans: Dict[Tuple[int, Tuple[str, ...]], Tuple[Plan, Any]] = {}
        self.plans_made = 0

    # -- the store ----------------------------------------------------------------------------

    def _put(self, key: str, value: Any) -> None:
        self.store.set(key, zlib.compress(json.dumps(value).encode()))

    def _get(self, key: str, rank: int, what: str) -> Any:
        try:
            raw = self.store.get(key)
        except Exception as e:  # torch raises its DistStoreError (a RuntimeError) on timeout
            raise RefitError(
                f"rank {self.rank}: rank {rank} did not report {what} within "
                f"{self.timeout_s:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            ) from None
        return json.loads(zlib.decompress(raw).decode())

    def agree(self, key: str, error: Optional[str]) -> None:
        """Publishes this rank's verdict (None: ready) under `key` and reads every rank's in
        rank order: raises RefitError with the first rank's error, the same on every rank that
        reads that far (a rank stops at the first error, so no rank waits on ranks behind a
        failed one)."""
        self._put(f"{key}/{self.rank}", error)
        for r in range(self.world_size):
            theirs = error if r == self.rank else self._get(f"{key}/{r}", r, key.split("/")[0])
            if theirs is not None:
                raise RefitError(theirs if r == self.rank else f"rank {r}: {theirs}")

    # -- declarations and plans ---------------------------------------------------------------

    def declare(self, epoch: int, mine: Declaration) -> Refit:
        """Publishes this rank's declaration for `epoch`, reads every rank's and builds the
        refit from them (:func:`~ncclreshard.vllm.specs.build`): the same specs, or the same
        RefitError, on every rank."""
        start = time.perf_counter()
        # A rank's sources go under their digest, so ranks that declare the same tensors (the
        # trainers of FSDP2 all do) are fetched and parsed once.
        body = mine.to_json()
        blob = {"layouts": body.pop("layouts"), "sources": body.pop("sources")}
        body["sources"] = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
        self._put(f"sources/{epoch}/{body['sources']}", blob)
        self._put(f"declaration/{epoch}/{self.rank}", body)
        parsed: Dict[str, Declaration] = {}
        declarations = []
        for r in range(self.world_size):
            if r == self.rank:
                declarations.append(mine)
                continue
            theirs = self._get(f"declaration/{epoch}/{r}", r, "its declaration")
            digest = theirs.pop("sources")
            if digest not in parsed:
                blob = self._get(f"sources/{epoch}/{digest}", r, "its sources")
                parsed[digest] = Declaration.from_json(dict(rank=r, role="", pieces=[], **blob))
            declarations.append(Declaration.from_json(dict(theirs, layouts=[], sources=[])))
            declarations[-1] = dataclasses.replace(declarations[-1], sources=parsed[digest].sources)
        refit = build(declarations)
        logger.info("ncclreshard: epoch %d declared, %d tensors, %.3f s", epoch, len(refit.specs),
                    time.perf_counter() - start)
        return refit

    def plan(self, epoch: int, refit: Refit) -> Tuple[Plan, Any]:
        """The plan (and torch transport) of `refit`, made on first use and checked: every
        rank's fingerprint must equal this rank's (RefitError on every rank otherwise)."""
        key = (epoch, refit.names)
        found = self._plans.get(key)
        if found is not None:
            return found
        start = time.perf_counter()
        error: Optional[str] = None
        plan: Optional[Plan] = None
        try:
            plan = Plan(list(refit.specs), self.rank, self.config)
        except (ValueError, TypeError, RuntimeError) as e:
            error = f"plan creation failed: {e}"
        index = len(self._plans)
        self.agree(f"plan/{epoch}/{index}", error)
        assert plan is not None
        self._put(f"fingerprint/{epoch}/{index}/{self.rank}", plan.fingerprint)
        for r in range(self.world_size):
            theirs = self._get(f"fingerprint/{epoch}/{index}/{r}", r, "its plan's fingerprint")
            if theirs != plan.fingerprint:
                raise RefitError(
                    f"rank {r} planned fingerprint {theirs:#018x} and rank {self.rank} "
                    f"{plan.fingerprint:#018x}: the ranks made different plans from one declaration"
                )
        transport: Any = None
        if self.transport == "torch":
            from ..torch_transport import TorchTransport

            transport = TorchTransport(plan, self.group)
        self._plans[key] = (plan, transport)
        self.plans_made += 1
        info = plan.info
        logger.info(
            "ncclreshard: rank %d planned %d tensors in %.3f s: %d peers, %d bytes sent, %d "
            "received, %d copied, %d rounds", self.rank, len(refit.specs),
            time.perf_counter() - start, info.peers, info.bytes_sent, info.bytes_received,
            info.bytes_copied, info.rounds,
        )
        return plan, transport

    # -- an update ----------------------------------------------------------------------------

    def run(
        self,
        epoch: int,
        step: int,
        refit: Refit,
        views: "Any",
        before: Optional[Any] = None,
    ) -> float:
        """Update `step` (the trainer's count, the same on every rank) of `refit`: `views(plan)`
        gives this rank's ``(src, dst, scales)`` view lists (`scales`: one per quantized tensor
        of the plan, ``plan.info.scale_tensors``); each rank checks them against the plan and
        all ranks agree (RefitError naming the first rank's problem, before anything is sent);
        then `before()` runs (e.g. zeroing padding) and the transport moves the data. Returns
        the transfer's seconds."""
        plan, transport = self.plan(epoch, refit)
        src: List[Optional[torch.Tensor]] = []
        dst: List[Optional[torch.Tensor]] = []
        scales: List[Optional[torch.Tensor]] = []
        error: Optional[str] = None
        try:
            src, dst, scales = views(plan)
            if transport is not None:
                transport.check_tensors(src, dst, scales)
            else:
                plan.check_views(src, dst, scales)
        except Exception as e:  # this rank's views are wrong: every rank must learn it
            error = f"{type(e).__name__}: {e}"
        self.agree(f"update/{step}", error)
        if step >= 2:  # every rank read step - 2's verdicts before it published step - 1's
            self.store.delete_key(f"update/{step - 2}/{self.rank}")
        if before is not None:
            before()
        start = time.perf_counter()
        if transport is not None:
            transport.reshard(src, dst, scales)
        else:
            from ..comm import comm_wait

            plan.reshard(src, dst, self.comm, scales=scales)
            if self.config.timeout_ms:
                comm_wait(self.comm)  # raises RemoteError when a peer missed the deadline
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - start

    def publish(self, key: str, value: Any) -> None:
        self._put(key, value)

    def read(self, key: str, rank: int, what: str) -> Any:
        return self._get(key, rank, what)

    def close(self) -> None:
        """Destroys the plans and the communicator and drops the process group and the store
        (on trainer rank 0 that stops the store: close it last, after the workers' last
        update)."""
        for plan, _ in self._plans.values():
            plan.close()
        self._plans.clear()
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.group = None
        self._store = None
        self.store = None


__all__ = ["Session", "TRANSPORTS"]
