"""Layout.from_dtensor and local_shape/local_runs against PyTorch's own DTensor: for random
meshes (any rank table), placements (Shard, Replicate, _StridedShard on the same or different
dims) and shapes (uneven and empty shards), each rank's `to_local()` computed by torch — on
the fake backend, every rank in turn — must be exactly the global tensor at the indices the
library gives for that rank."""

from __future__ import annotations

import math
import random
from typing import List

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import ncclreshard as nr
from conftest import fake_rank, gather


def _random_case(rng: random.Random):
    ndim = rng.randint(1, 3)
    shape = [rng.randint(0, 11) for _ in range(ndim)]
    axes = rng.randint(1, 3)
    mesh_shape: List[int] = []
    while len(mesh_shape) < axes:
        n = rng.randint(1, 3)
        if math.prod(mesh_shape) * n <= 8:
            mesh_shape.append(n)
        else:
            mesh_shape.append(1)
    world = rng.randint(math.prod(mesh_shape), 10)
    ranks = rng.sample(range(world), math.prod(mesh_shape))
    placements = []
    for _ in range(axes):
        kind = rng.random()
        dim = rng.randrange(ndim)
        if kind < 0.25:
            placements.append(Replicate())
        elif kind < 0.7:
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=rng.randint(1, 4)))
    return shape, mesh_shape, ranks, world, placements


def _ours(p) -> nr.Placement:
    if isinstance(p, _StridedShard):
        return nr.StridedShard(p.dim, p.split_factor)
    if isinstance(p, Shard):
        return nr.Shard(p.dim)
    return nr.Replicate()


@pytest.mark.parametrize("seed", range(40))
def test_local_shards_match_torch_dtensor(seed: int) -> None:
    rng = random.Random(seed)
    shape, mesh_shape, ranks, world, placements = _random_case(rng)
    global_tensor = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    expected_layout = nr.Layout(mesh_shape, ranks, [_ours(p) for p in placements])
    for rank in ranks:
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", torch.tensor(ranks).reshape(mesh_shape))
            dtensor = distribute_tensor(global_tensor, mesh, placements, src_data_rank=None)
            local = dtensor.to_local()
            layout = nr.Layout.from_dtensor(dtensor)
        assert layout == expected_layout
        where = f"rank {rank} of {layout}, shape {shape}"
        assert nr.local_shape(layout, shape, rank) == tuple(local.shape), where
        assert torch.equal(gather(global_tensor, nr.local_runs(layout, shape, rank)), local), where


def test_strided_shard_is_fsdp2_plus_tp_right_to_left() -> None:
    # torch's _StridedShard docstring example: 8 rows, mesh [[0,1],[2,3]], FSDP over TP.
    layout = nr.Layout([2, 2], 0, [nr.StridedShard(0, 2), nr.Shard(0)])
    rows = [nr.local_runs(layout, (8, 8), r)[0] for r in range(4)]
    assert rows == [[(0, 2)], [(4, 6)], [(2, 4)], [(6, 8)]]


def test_from_dtensor_maps_torch_ranks_to_comm_ranks() -> None:
    # The trainer's DTensor lives on torch ranks 4..7 (a PP stage, interleaved); the reshard
    # communicator numbers them 0..3 in another order.
    with fake_rank(5, 8):
        mesh = DeviceMesh("cpu", torch.tensor([[6, 4], [7, 5]]))
        dtensor = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0), Shard(1)], src_data_rank=None)
        comm_rank = {4: 0, 5: 1, 6: 2, 7: 3}
        by_dict = nr.Layout.from_dtensor(dtensor, rank_map=comm_rank)
        by_list = nr.Layout.from_dtensor(dtensor._spec, rank_map=[9, 9, 9, 9, 0, 1, 2, 3])
        by_call = nr.Layout.from_dtensor(dtensor, rank_map=lambda r: r - 4)
        with pytest.raises(ValueError, match="rank_map has no entry for torch rank 6"):
            nr.Layout.from_dtensor(dtensor, rank_map={4: 0, 5: 1})
    assert by_dict == by_list == by_call
    assert by_dict.ranks == (2, 0, 3, 1) and by_dict.mesh_shape == (2, 2)
    assert by_dict.placements == (nr.Shard(0), nr.Shard(1))
    # torch rank 5 is comm rank 1: its local shape is torch's to_local() shape on rank 5.
    assert nr.local_shape(by_dict, (6, 4), 1) == tuple(dtensor.to_local().shape)


def test_partial_is_refused_with_a_clear_message() -> None:
    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", torch.tensor([0, 1]))
        dtensor = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        with pytest.raises(ValueError, match=r"placements\[0\] is Partial.*reduce first"):
            nr.Layout.from_dtensor(dtensor)


def test_from_dtensor_refuses_a_plain_tensor() -> None:
    with pytest.raises(TypeError, match="expected a torch DTensor or DTensorSpec, got Tensor"):
        nr.Layout.from_dtensor(torch.ones(3))


def test_local_shape_errors_name_the_field() -> None:
    layout = nr.Layout([2], 0, [nr.Shard(2)])
    with pytest.raises(ValueError, match="placements\\[0\\]"):
        nr.local_shape(layout, (4, 4), 0)
    with pytest.raises(ValueError, match="rank 5 is not in the layout's mesh"):
        nr.local_shape(nr.Layout([2], 0, [nr.Shard(0)]), (4, 4), 5)


def test_shard_blocks_hold_vllms_vocab_blocks() -> None:
    # Not a torch placement: vLLM's vocab-parallel embedding at TP 4 holds blocks of 288 rows
    # of a vocabulary of 1100 padded to 1152 (torch.chunk would give 275 each).
    layout = nr.Layout([4], 0, [nr.ShardBlocks(0, 288)])
    rows = [nr.local_runs(layout, (1100, 16), r)[0] for r in range(4)]
    assert rows == [[(0, 288)], [(288, 576)], [(576, 864)], [(864, 1100)]]
    assert nr.local_shape(layout, (1100, 16), 3) == (236, 16)
    assert nr.placements.parse("ShardBlocks(0,288)") == nr.ShardBlocks(0, 288)
    assert str(nr.ShardBlocks(0, 288)) == "ShardBlocks(0,288)"
    with pytest.raises(ValueError, match="block is 0"):
        nr.ShardBlocks(0, 0)
    # Blocks that leave rows to no rank are refused by the library, naming the least block.
    with pytest.raises(ValueError, match="a block must be at least 275"):
        nr.local_shape(nr.Layout([4], 0, [nr.ShardBlocks(0, 274)]), (1100, 16), 0)
