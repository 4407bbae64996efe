"""Plans from Python: what they report, that every tensor is checked before anything reaches
NCCL (bad dtype, shape, strides, device, a tensor the plan does not expect, a closed plan), the
plan cache, and whole reshards run on the host from the plans' exported transfers."""

from __future__ import annotations

import random
from typing import Dict, List, Optional

import pytest
import torch

import ncclreshard as nr
from ncclreshard import _lib
from conftest import gather, run_transfers

# 10 x 6 bf16 "o_proj": TP2 on dim 1 over ranks 0, 1 -> TP2 on dim 0 over ranks 2, 3, where
# rank 3's view sits in a buffer 8 columns wide.
SRC = nr.Layout([2], 0, [nr.Shard(1)])
DST = nr.Layout([2], 2, [nr.Shard(0)], strides=(8, 1))
SPEC = nr.TensorSpec("o_proj.weight", (10, 6), torch.bfloat16, SRC, DST)
BIAS = nr.TensorSpec("o_proj.bias", (10,), torch.float32, nr.Layout([1], 0, [nr.Replicate()]),
                     nr.Layout([2], 2, [nr.Replicate()]))


@pytest.fixture
def no_library_calls(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Records every libncclreshard call made through the package after plan creation."""
    calls: List[str] = []
    real = _lib._Library.call

    def spy(self, function, *args):
        calls.append(function)
        return real(self, function, *args)

    monkeypatch.setattr(_lib._Library, "call", spy)
    return calls


def test_info_and_transfers_describe_the_same_plan() -> None:
    infos = {}
    for rank in range(4):
        with nr.Plan([SPEC, BIAS], rank, nr.Config(mode="staged")) as plan:
            info, transfers = plan.info, plan.transfers()
            infos[rank] = info
            assert info.rank == rank and info.ntensors == 2 and info.mode == "staged"
            assert not info.groupable
            for kind, total in (("send", info.bytes_sent), ("recv", info.bytes_received),
                                ("local", info.bytes_copied)):
                assert sum(t.bytes for t in transfers if t.kind == kind) == total
    assert len({i.fingerprint for i in infos.values()}) == 1
    assert infos[0].bytes_sent == 10 * 3 * 2 + 10 * 4 * 2  # its half of o_proj, the bias twice
    assert infos[3].bytes_received == 5 * 6 * 2 + 10 * 4  # its 5 rows of o_proj, the bias
    with nr.Plan([SPEC, BIAS], 0, nr.Config(mode="groupable")) as grouped:
        assert grouped.info.groupable and grouped.fingerprint != infos[0].fingerprint


def test_library_errors_name_the_tensor_and_field() -> None:
    bad = nr.TensorSpec("w", (4, 4), torch.float32, nr.Layout([2], 0, [nr.Shard(2)]), DST)
    with pytest.raises(nr.InvalidArgumentError, match=r"tensors\[0\] \('w'\)\.src: .*placements\[0\] = Shard\(2\) shards dim 2 but the tensor has 2 dims") as error:
        nr.Plan([bad], 0)
    assert isinstance(error.value, ValueError) and error.value.code == 4
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        nr.Plan([SPEC], -1)
    with pytest.raises(ValueError, match="mode is 'fastest'"):
        nr.Config(mode="fastest")
    with pytest.raises(TypeError, match="Shard.dim must be an int, got str"):
        nr.Shard("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ranks has 3 entries but mesh_shape \[2, 2\] holds 4"):
        nr.Layout([2, 2], [0, 1, 2], [nr.Replicate(), nr.Replicate()])
    with pytest.raises(ValueError, match="has no NCCL type"):
        nr.TensorSpec("c", (2,), torch.complex64, SRC, DST)


def _cpu_views(rank: int) -> "tuple[list, list]":
    src: List[Optional[torch.Tensor]] = [None, None]
    dst: List[Optional[torch.Tensor]] = [None, None]
    if rank < 2:
        src = [torch.zeros(10, 3, dtype=torch.bfloat16), torch.zeros(10) if rank == 0 else None]
    else:
        dst = [torch.zeros(5, 8, dtype=torch.bfloat16)[:, :6], torch.zeros(10)]
    return src, dst


@pytest.mark.parametrize(
    "rank, change, message",
    [
        (0, lambda s, d: (s[:1], d), r"src has 1 entries; the plan has 2 tensors"),
        (0, lambda s, d: ([s[0].float(), s[1]], d), r"src\[0\] \('o_proj.weight'\): dtype is torch.float32; the plan says torch.bfloat16"),
        (0, lambda s, d: ([torch.zeros(10, 4, dtype=torch.bfloat16), s[1]], d), r"src\[0\] \('o_proj.weight'\): shape is \[10, 4\]; rank 0's local shape is \[10, 3\]"),
        (0, lambda s, d: ([torch.zeros(3, 10, dtype=torch.bfloat16).t(), s[1]], d), r"src\[0\] \('o_proj.weight'\): not contiguous"),
        (0, lambda s, d: (s, [torch.zeros(5, 6), None]), r"dst\[0\] \('o_proj.weight'\): rank 0 is not in this tensor's dst mesh \[2, 3\]; pass None"),
        (1, lambda s, d: ([s[0], torch.zeros(10)], d), r"src\[1\] \('o_proj.bias'\): rank 1 is not in this tensor's src mesh \[0\]; pass None"),
        (0, lambda s, d: ([s[0], None], d), r"src\[1\] \('o_proj.bias'\) is None but rank 0 holds a src view of shape \[10\]"),
        (3, lambda s, d: (s, [torch.zeros(5, 6, dtype=torch.bfloat16), d[1]]), r"dst\[0\] \('o_proj.weight'\): strides are \[6, 1\]; the plan's layout says \[8, 1\]"),
        (3, lambda s, d: (s, d), r"dst\[0\] \('o_proj.weight'\): on cpu; reshard needs CUDA tensors"),
        (0, lambda s, d: ([s[0].float().numpy(), s[1]], d), r"src\[0\] \('o_proj.weight'\) must be a torch.Tensor or None, got ndarray"),
    ],
)
def test_bad_tensors_are_refused_before_any_nccl_call(rank, change, message, no_library_calls) -> None:
    with nr.Plan([SPEC, BIAS], rank) as plan:
        src, dst = _cpu_views(rank)
        src, dst = change(src, dst)
        before = list(no_library_calls)
        with pytest.raises((ValueError, TypeError), match=message):
            plan.reshard(src, dst, comm=0xDEAD)
        assert no_library_calls == before, "a refused call reached the library"


def test_a_closed_plan_refuses_everything(no_library_calls) -> None:
    plan = nr.Plan([SPEC], 2)
    plan.close()
    plan.close()  # a no-op the second time
    assert plan.closed and "closed" in repr(plan)
    before = list(no_library_calls)
    for use in (lambda: plan.info, lambda: plan.transfers(), lambda: plan.fingerprint,
                lambda: plan.reshard([None], [None], comm=0xDEAD)):
        with pytest.raises(ValueError, match=r"the plan of rank 2 \(1 tensors\) is closed"):
            use()
    assert no_library_calls == before


def test_comm_and_stream_must_be_handles() -> None:
    with nr.Plan([SPEC], 7) as idle:  # a rank in neither mesh: no tensors to check
        with pytest.raises(TypeError, match="comm must be an ncclreshard Communicator"):
            idle.reshard([None], [None], comm=None)
        with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream"):
            idle.reshard([None], [None], comm=0xDEAD, stream="default")


def test_plan_cache_reuses_plans_by_descriptor_and_finds_them_by_fingerprint() -> None:
    cache = nr.PlanCache()
    a = cache.get([SPEC, BIAS], 3)
    assert cache.get([SPEC, BIAS], 3) is a
    assert cache.get(nr.Case.loads(nr.Case((SPEC, BIAS)).dumps())[0], 3) is a  # shipped as JSON
    b = cache.get([SPEC, BIAS], 3, nr.Config(mode="groupable"))
    assert b is not a and len(cache) == 2
    assert cache.by_fingerprint(a.fingerprint) is a
    assert cache.by_fingerprint(b.fingerprint) is b
    assert cache.by_fingerprint(a.fingerprint ^ 1) is None
    cache.clear()
    assert a.closed and b.closed and len(cache) == 0


def _random_spec(rng: random.Random, i: int) -> nr.TensorSpec:
    ndim = rng.randint(1, 3)
    shape = [rng.randint(1, 7) for _ in range(ndim)]

    def layout(first: int) -> nr.Layout:
        mesh = [rng.randint(1, 3)]
        kind = rng.choice([nr.Replicate(), nr.Shard(rng.randrange(ndim)),
                           nr.StridedShard(rng.randrange(ndim), 2)])
        ranks = rng.sample(range(first, first + 4), mesh[0])
        return nr.Layout(mesh, ranks, [kind])

    return nr.TensorSpec(f"t{i}", shape, rng.choice([torch.float32, torch.int8, torch.bfloat16]),
                         layout(0), layout(rng.choice([0, 2, 4])))


@pytest.mark.parametrize("mode", ["groupable", "staged", "auto"])
def test_exported_transfers_reshard_every_byte_on_the_host(mode: str) -> None:
    rng = random.Random(mode)
    specs = [_random_spec(rng, i) for i in range(6)]
    config = nr.Config(mode=mode, ranks_per_node=4, rounds=2 if mode != "groupable" else None)
    ranks = range(8)
    globals_ = [torch.randint(-100, 100, s.shape).to(s.dtype) for s in specs]
    plans = {r: nr.Plan(specs, r, config) for r in ranks}
    src: Dict[int, list] = {}
    dst: Dict[int, list] = {}
    for r in ranks:
        src[r] = [gather(g, nr.local_runs(s.src, s.shape, r)).contiguous() if r in s.src.ranks else None
                  for s, g in zip(specs, globals_)]
        dst[r] = [torch.full(nr.local_shape(s.dst, s.shape, r), 55).to(s.dtype) if r in s.dst.ranks else None
                  for s in specs]
    run_transfers(plans, src, dst)
    for r in ranks:
        for s, g, got in zip(specs, globals_, dst[r]):
            if got is not None:
                assert torch.equal(got, gather(g, nr.local_runs(s.dst, s.shape, r))), (r, s)
        plans[r].close()
