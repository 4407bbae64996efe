"""Failures in Python (docs/resilience.md): deadlines and failed ranks in Config, holes in
layouts, survivors' plans run on the host against the global tensors, and the argument checks
of the communicator functions. The calls themselves, with a rank that dies, run on emulated
GPUs in python/examples/refit_torchrun.py --kill (scripts/python-tests.sh)."""

from __future__ import annotations

import json
import random
from typing import Dict, List

import pytest
import torch

import ncclreshard as nr
from ncclreshard import _lib
from conftest import gather, run_cli, run_transfers


def test_config_checks_the_deadline_and_the_failed_ranks() -> None:
    assert nr.Config(timeout_ms=0).timeout_ms == 0
    with pytest.raises(ValueError, match="timeout_ms is -1"):
        nr.Config(timeout_ms=-1)
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1"):
        nr.Config(timeout_ms=2**31)
    with pytest.raises(TypeError, match="timeout_ms must be an int"):
        nr.Config(timeout_ms=True)
    with pytest.raises(ValueError, match="names rank 3 twice"):
        nr.Config(failed_ranks=[3, 1, 3])
    with pytest.raises(ValueError, match=r"failed_ranks\[0\] is -2"):
        nr.Config(failed_ranks=[-2])
    assert nr.Config(failed_ranks=[5, 2]).failed_ranks == (2, 5)
    assert nr.Config(failed_ranks=[]).failed_ranks is None


def test_survivor_numbering_is_ncclcommshrinks() -> None:
    rng = random.Random(3)
    for _ in range(200):
        world = rng.randint(1, 40)
        failed = rng.sample(range(world), rng.randint(0, world - 1))
        config = nr.Config(failed_ranks=failed)
        survivors = [r for r in range(world) if r not in failed]  # NCCL keeps their order
        for new, old in enumerate(survivors):
            assert config.survivor_of(old) == new
            assert config.original_of(new) == old
        for r in failed:
            assert config.survivor_of(r) is None


def test_the_deadline_goes_to_the_library_but_not_into_case_files() -> None:
    spec = nr.TensorSpec("w", (8, 8), torch.float32, nr.Layout([2], 0, [nr.Shard(0)]),
                         nr.Layout([2], 2, [nr.Shard(1)]))
    c, _ = nr.Config(timeout_ms=1500).c_struct(_lib.lib().struct_version)
    assert c.timeoutMs == 1500 and c.failedRankCount == 0
    assert "timeout_ms" not in nr.Case((spec,), nr.Config(timeout_ms=1500)).to_json().get("config", {})
    # The deadline is not part of the fingerprint, yet a cache keeps plans with different ones apart.
    with nr.Plan([spec], 0) as a, nr.Plan([spec], 0, nr.Config(timeout_ms=1500)) as b:
        assert a.fingerprint == b.fingerprint
    cache = nr.PlanCache()
    assert cache.get([spec], 0, nr.Config(timeout_ms=1)) is not cache.get([spec], 0, nr.Config(timeout_ms=2))
    cache.clear()
    with pytest.raises(ValueError, match="unknown key"):
        nr.Config.from_json({"timeout_ms": 5})


def test_layouts_take_holes() -> None:
    layout = nr.Layout([3, 2], [0, 1, None, 3, 4, 5], [nr.Replicate(), nr.Shard(0)])
    assert layout.live_ranks == (0, 1, 3, 4, 5) and layout.first_rank is None
    assert layout.to_json()["ranks"] == [0, 1, None, 3, 4, 5]
    assert nr.Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    c, _ = layout.c_struct(_lib.lib().struct_version, "layout")
    assert [c.ranks[i] for i in range(6)] == [0, 1, _lib.RANK_NONE, 3, 4, 5]
    assert nr.local_shape(layout, (12, 4), 3) == (6, 4)
    with pytest.raises(ValueError, match="twice"):
        nr.Layout([3], [None, 1, 1], [nr.Shard(0)])


def _specs() -> List[nr.TensorSpec]:
    """Two trainer replicas (dp 2 × tp 2, ranks 0-3) to two inference replicas (2 × tp 4, 4-11)."""
    src = nr.Layout([2, 2], 0, [nr.Replicate(), nr.Shard(0)])
    return [
        nr.TensorSpec("qkv", (16, 12), torch.bfloat16, src, nr.Layout([2, 4], 4, [nr.Replicate(), nr.Shard(1)])),
        nr.TensorSpec("mlp", (24, 8), torch.float32, nr.Layout([2, 2], 0, [nr.Replicate(), nr.Shard(1)]),
                      nr.Layout([2, 4], 4, [nr.Replicate(), nr.Shard(0)])),
    ]


@pytest.mark.parametrize("mode", ["groupable", "staged", "auto"])
@pytest.mark.parametrize("failed", [[1], [2, 9], [0, 3, 4, 11]])
def test_survivors_plans_deliver_every_surviving_byte(mode: str, failed: List[int]) -> None:
    specs = _specs()
    world = 12
    config = nr.Config(mode=mode, ranks_per_node=4, split_min_bytes=16, failed_ranks=failed)
    survivors = [r for r in range(world) if r not in failed]
    globals_ = [torch.randint(-100, 100, s.shape).to(s.dtype) for s in specs]
    plans: Dict[int, nr.Plan] = {}
    src: Dict[int, list] = {}
    dst: Dict[int, list] = {}
    for new, old in enumerate(survivors):
        plan = nr.Plan(specs, new, config)
        assert plan.original_rank == old and plan.info.rank == new
        plans[new] = plan
        src[new] = [gather(g, nr.local_runs(s.src, s.shape, old)).contiguous() if old in s.src.ranks else None
                    for s, g in zip(specs, globals_)]
        dst[new] = [torch.full(nr.local_shape(s.dst, s.shape, old), 55).to(s.dtype) if old in s.dst.ranks else None
                    for s in specs]
        plan.check_tensors(src[new], dst[new], devices=False)
    run_transfers(plans, src, dst)
    for new, old in enumerate(survivors):
        for s, g, got in zip(specs, globals_, dst[new]):
            if got is not None:
                assert torch.equal(got, gather(g, nr.local_runs(s.dst, s.shape, old))), (old, s.name)
        for t in plans[new].transfers():
            assert t.kind == "local" or 0 <= t.peer < len(survivors)
        plans[new].close()


def test_every_survivor_gets_the_same_refusal_when_no_survivor_holds_a_shard() -> None:
    spec = nr.TensorSpec("w", (8, 8), torch.float32, nr.Layout([2, 2], 0, [nr.Replicate(), nr.Shard(0)]),
                         nr.Layout([4], 4, [nr.Shard(1)]))
    config = nr.Config(failed_ranks=[0, 2])  # both holders of rows 0-3
    messages = set()
    for new in range(6):
        with pytest.raises(nr.NcclReshardError) as refused:
            nr.Plan([spec], new, config)
        assert refused.value.code == _lib.INVALID_USAGE
        messages.add(refused.value.message)
    assert len(messages) == 1 and "no surviving rank holds" in messages.pop()


def test_case_files_with_failures_replay_through_the_cli(cli, tmp_path) -> None:
    cases = [
        nr.Case(tuple(_specs()), nr.Config(ranks_per_node=4, failed_ranks=[1, 6]), "dead"),
        nr.Case((nr.TensorSpec("h", (12, 6), torch.int8,
                               nr.Layout([3, 2], [0, 1, None, 3, 4, 5], [nr.Replicate(), nr.Shard(0)]),
                               nr.Layout([3], [6, None, 8], [nr.Shard(0)])),), nr.Config(mode="staged"), "holes"),
    ]
    path = tmp_path / "failures.json"
    path.write_text(json.dumps([c.to_json() for c in cases]))
    assert nr.Case.loads(path.read_text()) == cases
    result = run_cli(cli, "check", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout, result.stdout


def test_the_communicator_functions_check_their_arguments() -> None:
    for function in (nr.comm_status, nr.comm_wait, nr.comm_revoke, nr.comm_get_unique_id):
        with pytest.raises(TypeError, match="comm must be"):
            function(None)
        with pytest.raises(TypeError, match="comm must be"):
            function(0)
    with pytest.raises(TypeError, match="comm must be"):
        nr.comm_shrink(0, [1])
    with pytest.raises(ValueError, match="distinct non-negative"):
        nr.comm_shrink(0x1000, [1, 1])
    with pytest.raises(ValueError, match="one rank or more"):
        nr.comm_shrink(0x1000, [])
    with pytest.raises(ValueError, match="128"):
        nr.comm_grow(0x1000, 4, b"short")
    with pytest.raises(ValueError, match="new rank"):
        nr.comm_grow(None, 4)
    # A communicator no call with a deadline ran on: nothing running, nothing failed.
    assert nr.comm_status(0x1000) == "ok"
    nr.comm_wait(0x1000)
    assert issubclass(nr.RemoteError, nr.NcclReshardError)
    assert isinstance(_lib.error("f", _lib.REMOTE_ERROR, "m"), nr.RemoteError)
