"""Shared helpers: the repository's CLI, torch's fake process group (one process plays any
rank of a world, so DTensor computes that rank's shard on the CPU), and a host transport that
runs every rank's exported transfers (``Plan.transfers()``) with byte copies."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import pytest
import torch
import torch.distributed as dist

import ncclreshard as nr

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cli() -> Path:
    """The `ncclreshard` CLI of this repository (NCCLRESHARD_CLI, else target/release)."""
    path = Path(os.environ.get("NCCLRESHARD_CLI", REPO / "target" / "release" / "ncclreshard"))
    if not path.is_file():
        pytest.fail(f"{path} missing: cargo build --release -p ncclreshard-cli")
    return path


def run_cli(cli: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed initialised as `rank` of `world_size` on the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _bytes_of(t: torch.Tensor) -> "tuple[torch.Tensor, int]":
    """A uint8 tensor over `t`'s whole storage and `t`'s first byte in it."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat, t.storage_offset() * t.element_size()


def _copy(transfer: nr.Transfer, src: torch.Tensor, dst: torch.Tensor) -> None:
    (sb, so), (db, do) = _bytes_of(src), _bytes_of(dst)
    size = list(transfer.count) + [transfer.chunk_bytes]
    s = sb.as_strided(size, list(transfer.src_stride) + [1], so + transfer.src_offset)
    d = db.as_strided(size, list(transfer.dst_stride) + [1], do + transfer.dst_offset)
    d.copy_(s)


def run_transfers(
    plans: Dict[int, nr.Plan],
    src: Dict[int, Sequence[Optional[torch.Tensor]]],
    dst: Dict[int, Sequence[Optional[torch.Tensor]]],
) -> int:
    """Runs every rank's transfers on host tensors under the header's execution rule (round by
    round; a receive reads the peer's source view, or its destination view for a forward).
    Returns the bytes written."""
    lists = {rank: plan.transfers() for rank, plan in plans.items()}
    rounds = max((t.round for ts in lists.values() for t in ts), default=0)
    written = 0
    for r in range(rounds + 1):
        for rank, transfers in lists.items():
            for t in transfers:
                if t.round != r or t.kind == "send":
                    continue
                owner = rank if t.kind == "local" else t.peer
                view = src[owner][t.tensor] if t.src_view == "source" else dst[owner][t.tensor]
                target = dst[rank][t.tensor]
                assert view is not None and target is not None, (rank, t)
                _copy(t, view, target)
                written += t.bytes
    return written


def gather(global_tensor: torch.Tensor, runs: List[List["tuple[int, int]"]]) -> torch.Tensor:
    """The global tensor indexed by the Cartesian product of per-dim index runs."""
    out = global_tensor
    for d, dim_runs in enumerate(runs):
        index = torch.cat([torch.arange(a, b) for a, b in dim_runs]) if dim_runs else torch.arange(0)
        out = out.index_select(d, index)
    return out
