"""NeMo RL's ``xferdtensor`` signature on ncclreshard: real gloo worlds, DTensor-like objects as
NeMo RL passes them (``DTensorRef``-style ``.shape`` / ``._local_tensor``, a mesh object with a
``.mesh`` tensor, torch placements, a process group with ``.rank``), every destination element
checked against the global tensor, plans made once and reused across steps."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import ncclreshard as nr
from ncclreshard import nemo_rl as xfer_module
from torch_world import run_world


class Ref:
    """NeMo RL's DTensorRef: the global shape and this rank's local tensor."""

    def __init__(self, local: torch.Tensor, shape: Sequence[int]) -> None:
        self._local_tensor = local
        self.shape = torch.Size(shape)
        self.dtype = local.dtype


class MeshInfo:
    def __init__(self, ranks: Sequence[int], shape: Sequence[int]) -> None:
        self.mesh = torch.tensor(list(ranks)).reshape(list(shape))


class Group:
    """NeMo RL's process group as xferdtensor reads it: ``.rank``; no NCCL communicator, so
    the torch transport runs on torch's default (gloo) group."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.nccl_communicator = None


def _global(shape: Sequence[int], step: int) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32).reshape(list(shape)) * (step + 1)).to(torch.bfloat16)


def _local(global_tensor: torch.Tensor, layout: nr.Layout, rank: int) -> torch.Tensor:
    out = global_tensor
    for d, runs in enumerate(nr.local_runs(layout, tuple(global_tensor.shape), rank)):
        index = torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.arange(0)
        out = out.index_select(d, index)
    return out.contiguous()


CASES: List[Any] = [
    # (shape, src ranks, src mesh shape, src placements, dst ranks, dst mesh shape, dst placements)
    ((10, 6), [0, 1], [2], [Shard(1)], [2, 3], [2], [Shard(0)]),  # Megatron TP -> vLLM TP
    ((9, 8), [0, 1, 2, 3], [2, 2], [_StridedShard(0, split_factor=2), Shard(0)], [3, 2], [2],
     [Shard(1)]),  # FSDP2 + TP -> TP, sharing ranks
    ((7, 5), [1], [1], [Replicate()], [0, 1, 2, 3], [4], [Shard(0)]),  # uneven, colocated
]


def _rank(rank: int, world: int) -> List[bytes]:
    out = []
    group = Group(rank)
    for step in range(2):
        for shape, sr, sm, sp, dr, dm, dp in CASES:
            full = _global(shape, step)
            src_layout = nr.Layout(sm, sr, [xfer_module._placement(p, i) for i, p in enumerate(sp)])
            dst_layout = nr.Layout(dm, dr, [xfer_module._placement(p, i) for i, p in enumerate(dp)])
            src = Ref(_local(full, src_layout, rank), shape) if rank in sr else None
            dst = None
            if rank in dr:
                local_shape = nr.local_shape(dst_layout, shape, rank)
                # A strided destination buffer (a view of a wider parameter), as vLLM's are.
                wide = torch.zeros(local_shape[0], local_shape[1] + 3, dtype=torch.bfloat16)
                dst = Ref(wide[:, : local_shape[1]], shape)
            nr.xferdtensor(src, MeshInfo(sr, sm), sp, dst, MeshInfo(dr, dm), dp, group)
            if dst is not None:
                want = _local(full, dst_layout, rank)
                assert torch.equal(dst._local_tensor, want), (rank, shape, step)
                out.append(dst._local_tensor.view(torch.int16).numpy().tobytes())
    # Plans are made once per layout and rank, then reused.
    out.append(str(len(xfer_module._CACHE)).encode())
    return out


def test_xferdtensor_moves_every_element_and_reuses_its_plans() -> None:
    results = run_world(4, _rank)
    for rank, outputs in enumerate(results):
        cached = int(outputs[-1])
        involved = sum(1 for c in CASES if rank in c[1] or rank in c[4])
        assert cached == involved, (rank, cached, involved)


def test_bad_arguments_name_what_is_wrong() -> None:
    group = Group(0)
    t = Ref(torch.zeros(4, 4), (4, 4))
    with pytest.raises(ValueError, match="dst_placement has 2 entries but dst_mesh has 1 axes"):
        nr.xferdtensor(t, MeshInfo([0], [1]), [Replicate()], None, MeshInfo([1], [1]),
                       [Shard(0), Shard(1)], group)
    with pytest.raises(TypeError, match="src_mesh must be DeviceMesh-like"):
        nr.xferdtensor(t, object(), [Replicate()], None, MeshInfo([1], [1]), [Shard(0)], group)
    with pytest.raises(TypeError, match="src_tensor must be DTensor-like"):
        nr.xferdtensor(torch.zeros(4), MeshInfo([0], [1]), [Replicate()], None,
                       MeshInfo([1], [1]), [Shard(0)], group)
    with pytest.raises(ValueError, match="dst_tensor.shape is"):
        nr.xferdtensor(t, MeshInfo([0], [1]), [Replicate()], Ref(torch.zeros(4, 4), (5, 4)),
                       MeshInfo([0], [1]), [Shard(0)], group)
    # A rank in neither mesh has nothing to do.
    assert nr.xferdtensor(None, MeshInfo([1], [1]), [Replicate()], None, MeshInfo([2], [1]),
                          [Shard(0)], group) is None
