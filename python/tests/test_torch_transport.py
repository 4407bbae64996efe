"""The torch transport (ncclreshard.TorchTransport) in real multi-process gloo worlds on the
CPU, byte-exact against the specification: for every case the Rust host executor runs the same
plan on the same bytes (`ncclreshard execute`), and every byte of every destination and scale
view the transport leaves — gaps of strided views included — must equal what the host executor
leaves. Plain tensors are also checked against the global tensor directly. Cases: every case
of the repository's case files that fits in 12 ranks (every mode: uneven and empty shards,
strided views, colocated ranks, replicated sources, 0-d to 8-d tensors, staged rounds, relays
with forwards, survivors' plans, every quantization scheme), random layouts, all 65,536 bf16
and float16 bit patterns and FP32 rounding boundaries through every cast, and a fused vLLM
parameter filled through its per-tensor views. Bad input raises before anything is sent; a
stalled or dead peer ends a call with a deadline by RemoteError; a peer that planned otherwise
is caught by the fingerprints."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

import ncclreshard as nr
from ncclreshard import recipes
from ncclreshard.plan import _dense
from conftest import REPO, fake_rank, gather, run_cli
from test_json import _random_case
from test_recipes import HEAD_DIM, HIDDEN, _hf, megatron_qkv, vllm_qkv
from torch_world import run_world

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ints(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as same-size integers (bit patterns compare exactly, NaNs included)."""
    return t.view(_INTS[t.element_size()])


def _extent(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * itemsize


def _views(plan: nr.Plan) -> List[Tuple[str, Tuple[int, ...], Tuple[int, ...], torch.dtype]]:
    """Every view this rank holds: (file key as `ncclreshard execute` names it, local shape,
    element strides, dtype); scale views are ``dst.{ntensors + k}``."""
    out = []
    for t, spec in enumerate(plan.tensors):
        for side, layout, dtype in (("src", spec.src, spec.dtype), ("dst", spec.dst, spec.dst_dtype or spec.dtype)):
            shape = plan.local_shape(t, side)
            if shape is not None:
                out.append((f"{side}.{t}", shape, layout.strides or _dense(shape), dtype))
    n = len(plan.tensors)
    for k, view in enumerate(plan.scale_views()):
        if view.local_shape is not None:
            strides = view.layout.strides or _dense(view.local_shape)
            out.append((f"dst.{n + k}", view.local_shape, strides, view.dtype))
    return out


def _typed(buffer: torch.Tensor, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The view over a buffer of the view's extent."""
    if buffer.numel() == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return buffer.view(dtype).as_strided(tuple(shape), tuple(strides))


# --- source values -------------------------------------------------------------------------

def _float_values(shape: Sequence[int], block: Sequence[int], g: torch.Generator) -> torch.Tensor:
    """FP32 values as quantization meets them, one kind per block (of `block` elements along
    each dim): mostly magnitudes 2^-12..2^12, some blocks all zero (with -0.0), of tiny (1e-6)
    or huge (1e30) values, or with NaNs or infinities among ordinary values."""
    shape = tuple(shape)
    grid = [-(-n // b) for n, b in zip(shape, block)]
    blocks = 1
    for n in grid:
        blocks *= n
    block_id = torch.zeros(shape, dtype=torch.int64)
    step = 1
    for d in reversed(range(len(shape))):
        index = torch.arange(shape[d]) // block[d]
        block_id += (index * step).reshape([-1 if k == d else 1 for k in range(len(shape))])
        step *= grid[d]
    kind = torch.randint(0, 16, (max(blocks, 1),), generator=g)[block_id]
    exponent = torch.randint(-12, 13, (max(blocks, 1),), generator=g)[block_id].double()
    unit = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    magnitude = torch.where(kind == 0, 0.0, torch.where(kind == 1, 1e-6, torch.where(kind == 2, 1e30, 2.0 ** exponent)))
    x = (unit * magnitude).float()
    roll = torch.randint(0, 77, shape, generator=g)
    x = torch.where((kind == 3) & (roll % 7 == 0), float("nan"), x)
    x = torch.where((kind == 4) & (roll % 11 == 0), torch.where(roll % 2 == 0, float("inf"), float("-inf")), x)
    return torch.where((kind == 0) & (roll % 2 == 1), -0.0, x)


def _global_source(spec: nr.TensorSpec, g: torch.Generator) -> torch.Tensor:
    if spec.dst_dtype is not None:
        quant = spec.quant or nr.Quant("none")
        return _float_values(spec.shape, quant.block_shape(spec.shape), g).to(spec.dtype)
    count = 1
    for n in spec.shape:
        count *= n
    raw = torch.randint(0, 256, (count * spec.dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(spec.dtype).reshape(spec.shape)


# --- one case: the specification's bytes, then the transport's -----------------------------

@dataclasses.dataclass
class Prepared:
    case: nr.Case
    sources: Dict[int, torch.Tensor]  # tensor -> global source tensor (given or random)
    inputs: Dict[int, Dict[str, bytes]]  # rank -> view key -> bytes as the views start
    expected: Dict[int, Dict[str, bytes]]  # rank -> destination/scale view key -> host executor's bytes


def _variants(case: nr.Case) -> List[nr.Case]:
    """The case under each mode it runs in (`ncclreshard check` runs a case without a mode
    under every mode; groupable does not convert)."""
    if case.config.mode is not None:
        return [case]
    converts = any(t.dst_dtype is not None for t in case.tensors)
    modes = ["staged", "auto"] if converts else ["groupable", "staged", "auto"]
    return [
        nr.Case(case.tensors, dataclasses.replace(case.config, mode=m), f"{case.name}[{m}]")
        for m in modes
    ]


def _prepare(cli: Path, tmp: Path, case: nr.Case, world: int, seed: int,
             sources: Optional[Dict[int, torch.Tensor]] = None) -> Prepared:
    """Every rank's views filled (elements from the global sources, random bytes around them
    and in destinations), and what the host executor leaves in the destinations."""
    g = torch.Generator().manual_seed(seed)
    sources = dict(sources or {})
    for t, spec in enumerate(case.tensors):
        if t not in sources:
            sources[t] = _global_source(spec, g)
    inputs: Dict[int, Dict[str, bytes]] = {}
    for rank in range(world):
        plan = nr.Plan(case, rank)
        files = {}
        for key, shape, strides, dtype in _views(plan):
            extent = _extent(shape, strides, dtype.itemsize)
            buffer = torch.randint(0, 256, (extent,), dtype=torch.uint8, generator=g)
            side, t = key.split(".")
            if side == "src" and extent:
                spec = case.tensors[int(t)]
                runs = nr.local_runs(spec.src, spec.shape, plan.original_rank)
                _ints(_typed(buffer, shape, strides, dtype)).copy_(_ints(gather(sources[int(t)], runs)))
            files[key] = buffer.numpy().tobytes()
        plan.close()
        inputs[rank] = files
    folder = tmp / case.name.replace("/", "_")
    (folder / "in").mkdir(parents=True)
    (folder / "case.json").write_text(case.dumps())
    for rank, files in inputs.items():
        for key, data in files.items():
            if data:
                (folder / "in" / f"{rank}.{key}").write_bytes(data)
    result = run_cli(cli, "execute", str(folder / "case.json"), "--input", str(folder / "in"),
                     "--output", str(folder / "out"))
    assert result.returncode == 0, f"{case.name}: {result.stdout}{result.stderr}"
    expected = {
        rank: {key: (folder / "out" / f"{rank}.{key}").read_bytes()
               for key in files if key.startswith("dst.") and files[key]}
        for rank, files in inputs.items()
    }
    return Prepared(case, sources, inputs, expected)


def _run_rank(rank: int, world: int, jobs: List[Tuple[str, Dict[str, bytes]]],
              steps: int = 1) -> List[Tuple[Dict[str, bytes], Dict[str, int]]]:
    """On one rank of the world: every case's plan, transport and call on the given bytes;
    returns the destination views' bytes and what the transport sent."""
    out = []
    for text, files in jobs:
        case = nr.Case.loads(text)[0]
        plan = nr.Plan(case, rank)
        n = len(plan.tensors)
        buffers, views = {}, {}
        for key, shape, strides, dtype in _views(plan):
            buffers[key] = torch.frombuffer(bytearray(files[key]), dtype=torch.uint8) if files[key] else torch.empty(0, dtype=torch.uint8)
            views[key] = _typed(buffers[key], shape, strides, dtype)
        src = [views.get(f"src.{t}") for t in range(n)]
        dst = [views.get(f"dst.{t}") for t in range(n)]
        scales = [views.get(f"dst.{n + k}") for k in range(len(plan.scale_views()))]
        transport = nr.TorchTransport(plan)  # once per plan; called every step
        for _ in range(steps):
            transport.reshard(src, dst, scales)
        info = plan.info
        stats = {
            "messages": transport.messages_sent, "plan_messages": info.messages_sent,
            "bytes": transport.bytes_sent, "plan_bytes": info.bytes_sent,
            "forwards": sum(1 for t in plan.transfers() if t.kind == "send" and t.src_view == "destination"),
        }
        out.append(({k: b.numpy().tobytes() for k, b in buffers.items() if k.startswith("dst.")}, stats))
        plan.close()
    return out


def _verify(prepared: List[Prepared], results: List[List[Tuple[Dict[str, bytes], Dict[str, int]]]]) -> Dict[str, int]:
    """Every destination and scale byte equals the host executor's; plain tensors' elements
    equal the global tensor's; the transport sends the plan's bytes in at most its messages."""
    totals = {"cases": 0, "bytes": 0, "messages": 0, "forwards": 0}
    for i, p in enumerate(prepared):
        totals["cases"] += 1
        for rank, per_case in enumerate(results):
            got, stats = per_case[i]
            assert got.keys() == {k for k in p.inputs[rank] if k.startswith("dst.")}, (p.case.name, rank)
            for key, want in p.expected[rank].items():
                if got[key] != want:
                    at = next(j for j, (a, b) in enumerate(zip(got[key], want)) if a != b)
                    pytest.fail(f"{p.case.name}: rank {rank} view {key}: byte {at} is {got[key][at]:#04x}, the host executor's {want[at]:#04x}")
            assert stats["bytes"] == stats["plan_bytes"], (p.case.name, rank, stats)
            assert stats["messages"] <= stats["plan_messages"], (p.case.name, rank, stats)
            totals["bytes"] += stats["bytes"]
            totals["messages"] += stats["messages"]
            totals["forwards"] += stats["forwards"]
        # The specification itself, independently, for tensors that arrive as they left.
        for rank in range(len(results)):
            plan = nr.Plan(p.case, rank)
            for key, shape, strides, dtype in _views(plan):
                side, t = key.split(".")
                if side != "dst" or int(t) >= len(p.case.tensors) or p.case.tensors[int(t)].dst_dtype is not None:
                    continue
                if not p.expected[rank].get(key):
                    continue
                spec = p.case.tensors[int(t)]
                view = _typed(torch.frombuffer(bytearray(p.expected[rank][key]), dtype=torch.uint8), shape, strides, dtype)
                runs = nr.local_runs(spec.dst, spec.shape, plan.original_rank)
                assert torch.equal(_ints(view), _ints(gather(p.sources[int(t)], runs))), (p.case.name, rank, key)
            plan.close()
    return totals


def _world(cases: Sequence[nr.Case]) -> int:
    """The ranks the cases' plans run on: their highest rank (among the survivors for a
    survivors' plan) plus one."""
    highest = 0
    for case in cases:
        layouts = [layout for spec in case.tensors for layout in (spec.src, spec.dst)]
        layouts += [spec.quant.scale_layout for spec in case.tensors if spec.quant and spec.quant.scale_layout]
        for layout in layouts:
            for r in layout.live_ranks:
                survivor = case.config.survivor_of(r)
                highest = max(highest, survivor if survivor is not None else 0)
    return highest + 1


def _run_cases(cli: Path, tmp: Path, cases: Sequence[nr.Case],
               sources: Optional[Dict[str, Dict[int, torch.Tensor]]] = None) -> Dict[str, int]:
    world = _world(cases)
    assert world <= 16, f"{world} processes on this machine's 2 cores: keep cases to 16 ranks"
    prepared = [
        _prepare(cli, tmp, case, world, seed, (sources or {}).get(case.name))
        for seed, case in enumerate(cases)
    ]
    jobs = [[(p.case.dumps(), p.inputs[rank]) for p in prepared] for rank in range(world)]
    results = run_world(world, _run_rank, [(jobs[r],) for r in range(world)])
    return _verify(prepared, results)


def _file_cases(name: str) -> List[nr.Case]:
    return [v for c in nr.Case.loads((REPO / "cases" / name).read_text()) for v in _variants(c)]


# --- the tests ------------------------------------------------------------------------------

def test_torch_examples_cases(cli: Path, tmp_path: Path) -> None:
    """Every case of cases/torch-examples.json (DTensor's own layouts: uneven, empty and
    strided shards, nested meshes, 0-d to 8-d tensors, every dtype), every mode."""
    cases = _file_cases("torch-examples.json")
    totals = _run_cases(cli, tmp_path, cases)
    assert totals["cases"] == len(cases) > 70 and totals["bytes"] > 0


def test_rounds_relays_and_survivors_cases(cli: Path, tmp_path: Path) -> None:
    """cases/rounds-and-relays.json (staged rounds, relays whose forwards read the
    destination view of an earlier round's receive, multi-tensor plans, colocated ranks) and
    cases/survivors.json (survivors' plans: the world is the survivors', views cut for each
    survivor's original rank)."""
    cases = _file_cases("rounds-and-relays.json")
    # The refused survivors' case has no plan anywhere; the others run on the survivors.
    cases += [c for c in _file_cases("survivors.json") if c.name != "no-survivor-holds-a-shard"]
    totals = _run_cases(cli, tmp_path, cases)
    assert totals["forwards"] > 0, "no plan here forwards relayed data"


def test_quantize_cases(cli: Path, tmp_path: Path) -> None:
    """cases/quantize.json: block 128 x 128 converted by senders and by receivers, E8M0 and
    inverted scales, per tensor, per channel, MX 1 x 32, stacked experts with replicated
    scales, casts; source blocks of zeros, tiny, huge, NaN and infinite values."""
    totals = _run_cases(cli, tmp_path, _file_cases("quantize.json"))
    assert totals["cases"] == 21


def test_random_layouts(cli: Path, tmp_path: Path) -> None:
    """Random meshes, placements (Shard, Replicate, _StridedShard), padded destination views,
    dtypes, modes and topologies on 8 ranks."""
    rng = random.Random(24)
    cases = [_random_case(rng, i) for i in range(16)]
    totals = _run_cases(cli, tmp_path, cases)
    assert totals["cases"] == 16


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16-bit float type, as a [256, 256] tensor."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)


def _boundaries() -> torch.Tensor:
    """FP32 values at and next to every rounding boundary of every cast target (midpoints
    between neighbouring values, where ties go to even, and the overflow midpoint), both
    signs, plus random FP32 bit patterns."""
    pieces = []
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        bits = 16 if dtype.itemsize == 2 else 8
        codes = torch.arange(0, 1 << (bits - 1), dtype=torch.int32).to(_INTS[dtype.itemsize])
        values = codes.view(dtype).double()
        values = values[torch.isfinite(values)]
        # The midpoint above the largest finite value: where bfloat16/float16 overflow.
        top = values[-1] + (values[-1] - values[-2]) / 2
        mids = torch.cat([(values[1:] + values[:-1]) / 2, top.reshape(1)]).float()
        up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
        down = torch.nextafter(mids, torch.zeros_like(mids))
        pieces += [mids, up, down]
    g = torch.Generator().manual_seed(5)
    pieces.append(torch.randint(-(1 << 31), 1 << 31, (1 << 16,), dtype=torch.int64, generator=g).to(torch.int32).view(torch.float32))
    x = torch.cat(pieces)
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])])
    width = 512
    padded = torch.zeros(-(-x.numel() // width) * width)
    padded[: x.numel()] = x
    return padded.reshape(-1, width)


def test_every_bit_pattern_through_every_cast(cli: Path, tmp_path: Path) -> None:
    """All 65,536 bfloat16 and float16 values, and FP32 values around every rounding boundary
    of every target, cast on the way (each rank converts what it sends), and the bfloat16
    patterns quantized per channel (rows with infinities and NaNs), byte-exact."""
    src = nr.Layout([2], 0, [nr.Shard(0)])
    dst = nr.Layout([2], 2, [nr.Shard(1)])
    f32 = _boundaries()
    tensors, sources = [], {}
    for source, name in ((_patterns(torch.bfloat16), "bf16"), (_patterns(torch.float16), "f16"), (f32, "f32")):
        for target in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
            if target == source.dtype:
                continue
            sources[len(tensors)] = source
            tensors.append(nr.TensorSpec(f"{name}->{target}", tuple(source.shape), source.dtype, src, dst, dst_dtype=target))
    sources[len(tensors)] = _patterns(torch.bfloat16)
    tensors.append(nr.TensorSpec("bf16 per channel", (256, 256), torch.bfloat16, src, dst,
                                 dst_dtype=torch.float8_e4m3fn, quant=nr.Quant("per_channel")))
    case = nr.Case(tuple(tensors), nr.Config(mode="staged"), "every-bit-pattern")
    totals = _run_cases(cli, tmp_path, [case], {case.name: sources})
    assert totals["cases"] == 1


def test_conversions_on_python_written_cases(cli: Path, tmp_path: Path) -> None:
    """Quantization the repository's case files do not cover: E5M2 blocks converted by
    receivers with inverted E8M0 scales in 3 rounds, per-tensor E4M3 on a strided view with
    inverted FP32 scales, per-channel scales on a layout of their own (replicated), a 3-D
    stack of experts with 1 x 32 blocks, and a plan mixing them with a plain tensor."""
    straddle = nr.TensorSpec("e5m2-receivers", (300, 260), torch.float16, nr.Layout([3], 0, [nr.Shard(1)]),
                             nr.Layout([2], 3, [nr.Shard(1)]), dst_dtype=torch.float8_e5m2,
                             quant=nr.Quant("block", block=(100, 130), scale_format="e8m0", scale_inverse=True))
    per_tensor = nr.TensorSpec("per-tensor-strided", (40, 24), torch.float32, nr.Layout([2], 0, [nr.Shard(1)]),
                               nr.Layout([2], 1, [nr.Replicate()], strides=(30, 1)), dst_dtype=torch.float8_e4m3fn,
                               quant=nr.Quant("per_tensor", scale_inverse=True))
    channel = nr.TensorSpec("per-channel-own-scale-layout", (48, 64), torch.bfloat16, nr.Layout([2], 0, [nr.Shard(0)]),
                            nr.Layout([4], 2, [nr.Shard(1)]), dst_dtype=torch.float8_e4m3fn,
                            quant=nr.Quant("per_channel", scale_layout=nr.Layout([2], 4, [nr.Replicate()])))
    experts = nr.TensorSpec("experts-mx", (4, 32, 96), torch.bfloat16, nr.Layout([2], 0, [nr.Shard(0)]),
                            nr.Layout([2, 2], 2, [nr.Shard(0), nr.Shard(2)]), dst_dtype=torch.float8_e4m3fn,
                            quant=nr.Quant("block", block=(1, 32), scale_format="e8m0"))
    plain = nr.TensorSpec("plain", (17, 9), torch.int64, nr.Layout([3], 0, [nr.Shard(0)]), nr.Layout([2], 4, [nr.Replicate()]))
    cases = [
        nr.Case((straddle,), nr.Config(mode="staged", rounds=3), "receivers-e5m2-e8m0-inverse"),
        nr.Case((per_tensor, channel, experts, plain), nr.Config(mode="auto", ranks_per_node=3, relay=True), "mixed"),
    ]
    assert any(t.src_view == "unconverted" for r in range(3, 5) for t in nr.Plan(cases[0], r).transfers())
    totals = _run_cases(cli, tmp_path, cases)
    assert totals["cases"] == 2


def _fused_rank(rank: int, world: int, heads: int, kv_heads: int, seeds: Sequence[int]) -> List[Any]:
    """Megatron TP2 (ranks 0-1) -> vLLM TP2 (ranks 2-3): the plan made once, called once per
    step with that step's weights; returns the inference ranks' fused qkv_proj after each."""
    train_ranks, infer_ranks = [0, 1], [2, 3]
    recipe = recipes.megatron_qkv_to_vllm(
        "linear_qkv", "qkv_proj", train_ranks, infer_ranks, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=HEAD_DIM, hidden_size=HIDDEN, dtype=torch.float32)
    plan = nr.Plan(recipe.specs, rank, nr.Config(mode="auto"))
    transport = nr.TorchTransport(plan)
    q_rows = heads // 2 * HEAD_DIM + 2 * max(1, kv_heads // 2) * HEAD_DIM
    qkv_proj = torch.full((q_rows, HIDDEN), float("nan"))
    out = []
    for seed in seeds:
        w = _hf(seed, q_proj=(heads * HEAD_DIM, HIDDEN), k_proj=(kv_heads * HEAD_DIM, HIDDEN), v_proj=(kv_heads * HEAD_DIM, HIDDEN))
        train = {"linear_qkv": megatron_qkv(w, heads, kv_heads, 2, rank)} if rank in train_ranks else {}
        infer = {"qkv_proj": qkv_proj} if rank in infer_ranks else {}
        transport.reshard(recipe.src_views(train, rank), recipe.dst_views(infer, rank))
        out.append(qkv_proj.clone().numpy() if rank in infer_ranks else None)
    return out


def test_fused_vllm_parameter_through_its_views() -> None:
    """The per-tensor views of a fused vLLM qkv_proj (recipes) filled in place, every step by
    the same plan and transport: each step's parameter is what vLLM's loader makes of that
    step's weights."""
    heads, kv_heads, seeds = 8, 4, [11, 12]
    results = run_world(4, _fused_rank, [(heads, kv_heads, seeds)] * 4)
    for i, seed in enumerate(seeds):
        w = _hf(seed, q_proj=(heads * HEAD_DIM, HIDDEN), k_proj=(kv_heads * HEAD_DIM, HIDDEN), v_proj=(kv_heads * HEAD_DIM, HIDDEN))
        for tp_rank, rank in enumerate([2, 3]):
            assert torch.equal(torch.from_numpy(results[rank][i]), vllm_qkv(w, heads, kv_heads, 2, tp_rank)), (seed, rank)


def _bare_group_rank(rank: int, world: int, store_path: str) -> bytes:
    """A bare ProcessGroupGloo over its own store, numbered in reverse of the default group:
    the plan's ranks are the bare group's."""
    bare_rank = world - 1 - rank
    group = dist.ProcessGroupGloo(dist.FileStore(store_path, world), bare_rank, world, timedelta(seconds=60))
    spec = nr.TensorSpec("w", (6, 8), torch.float32, nr.Layout([2], 0, [nr.Shard(0)]),
                         nr.Layout([2], [2, 3], [nr.Shard(1)]))
    plan = nr.Plan([spec], bare_rank, nr.Config(mode="staged"))
    full = torch.arange(48, dtype=torch.float32).view(6, 8)
    src = [full[bare_rank * 3:bare_rank * 3 + 3].clone()] if bare_rank < 2 else [None]
    dst = [torch.zeros(6, 4)] if bare_rank >= 2 else [None]
    nr.TorchTransport(plan, group).reshard(src, dst)
    return dst[0].numpy().tobytes() if dst[0] is not None else b""


def test_a_bare_process_group_of_its_own_numbering(tmp_path: Path) -> None:
    """A process group torch.distributed does not know (made on a store, as trainer and
    inference processes with default groups of their own make one) carries the plan on its own
    ranks: bare ranks 2 and 3 (default ranks 1 and 0) get their columns."""
    store = str(tmp_path / "bare-store")
    results = run_world(4, _bare_group_rank, [(store,)] * 4)
    full = torch.arange(48, dtype=torch.float32).view(6, 8)
    for bare_rank in (2, 3):
        got = torch.frombuffer(bytearray(results[3 - bare_rank]), dtype=torch.float32).view(6, 4)
        assert torch.equal(got, full[:, (bare_rank - 2) * 4:(bare_rank - 1) * 4]), bare_rank


# --- refusals and failures -------------------------------------------------------------------

WEIGHT = nr.TensorSpec("w", (6, 8), torch.float32, nr.Layout([2], 0, [nr.Shard(0)]),
                       nr.Layout([2], 2, [nr.Shard(1)], strides=(10, 1)))
SCALED = nr.TensorSpec("q", (4, 64), torch.bfloat16, nr.Layout([2], 0, [nr.Shard(0)]), nr.Layout([2], 2, [nr.Replicate()]),
                       dst_dtype=torch.float8_e4m3fn, quant=nr.Quant("block", block=(1, 32), scale_format="e8m0"))


def test_bad_input_raises_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wrong tensor, scale view or process group raises naming it, with every
    point-to-point function of torch.distributed replaced by one that fails the test."""
    posted: List[str] = []

    def refuse(name: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            posted.append(name)
            raise AssertionError(f"dist.{name} called")
        return call

    # The transport's every message goes through batch_isend_irecv (isend and irecv stay:
    # P2POp accepts only torch's own).
    for name in ("batch_isend_irecv", "send", "recv"):
        monkeypatch.setattr(dist, name, refuse(name))
    src = [torch.zeros(3, 8), torch.zeros(2, 64, dtype=torch.bfloat16)]
    scales = [None]
    bad = [
        ([torch.zeros(3, 8, dtype=torch.float16), src[1]], [None, None], scales,
         r"src\[0\] \('w'\): dtype is torch.float16; the plan says torch.float32"),
        ([torch.zeros(4, 8), src[1]], [None, None], scales, r"src\[0\] \('w'\): shape is \[4, 8\]; rank 0's local shape is \[3, 8\]"),
        ([torch.zeros(8, 3).t(), src[1]], [None, None], scales, r"src\[0\] \('w'\): not contiguous"),
        ([None, src[1]], [None, None], scales, r"src\[0\] \('w'\) is None but rank 0 holds a src view of shape \[3, 8\]"),
        (src, [torch.zeros(6, 4), None], scales, r"dst\[0\] \('w'\): rank 0 is not in this tensor's dst mesh"),
        (src, [None, None], [torch.zeros(4, 2, dtype=torch.uint8)], r"scales\[0\] \(of tensors\[1\] \('q'\)\): rank 0 is not in the scales' mesh \[2, 3\]; pass None"),
        ([src[0], torch.zeros(2, 64, dtype=torch.bfloat16, device="meta")], [None, None], scales,
         r"src\[1\] \('q'\): on meta but src\[0\] \('w'\) is on cpu"),
        (src, [None], scales, r"dst has 1 entries; the plan has 2 tensors"),
    ]
    with fake_rank(0, 4):
        transport = nr.TorchTransport(nr.Plan([WEIGHT, SCALED], 0))
        for s, d, sc, message in bad:
            with pytest.raises(ValueError, match=message):
                transport.reshard(s, d, sc)
        # The group: this process's rank must be the plan's.
        dst = [torch.zeros(6, 10)[:, :4], torch.zeros(4, 64, dtype=torch.float8_e4m3fn)]
        with pytest.raises(ValueError, match=r"this process is rank 0 of the process group but the plan is rank 2's"):
            nr.TorchTransport(nr.Plan([WEIGHT, SCALED], 2)).reshard([None, None], dst, [torch.zeros(4, 2, dtype=torch.uint8)])
        assert posted == []
    with fake_rank(2, 4):
        # A destination rank: its scale view's dtype, shape and strides.
        receiver = nr.TorchTransport(nr.Plan([WEIGHT, SCALED], 2))
        for scale, message in [
            (torch.zeros(4, 2), r"scales\[0\] \(of tensors\[1\] \('q'\)\): dtype is torch.float32; the plan says torch.uint8"),
            (torch.zeros(4, 3, dtype=torch.uint8), r"scales\[0\] \(of tensors\[1\] \('q'\)\): shape is \[4, 3\]; rank 2's local shape is \[4, 2\]"),
            (torch.zeros(2, 4, dtype=torch.uint8).t(), r"scales\[0\] \(of tensors\[1\] \('q'\)\): not contiguous"),
            (None, r"scales\[0\] \(of tensors\[1\] \('q'\)\) is None but rank 2 holds a scale view of shape \[4, 2\]"),
        ]:
            with pytest.raises(ValueError, match=message):
                receiver.reshard([None, None], dst, [scale])
        with pytest.raises(ValueError, match=r"dst\[0\] \('w'\): strides are \[4, 1\]; the plan's layout says \[10, 1\]"):
            receiver.reshard([None, None], [torch.zeros(6, 4), dst[1]], [torch.zeros(4, 2, dtype=torch.uint8)])
        assert posted == []
    with fake_rank(0, 4):
        # The double is live: a good call on a sending rank reaches it.
        with pytest.raises(AssertionError, match="batch_isend_irecv called"):
            transport.reshard(src, [None, None], scales)
        assert posted == ["batch_isend_irecv"]
    with fake_rank(0, 3):
        with pytest.raises(ValueError, match=r"the process group has 3 ranks but the plan's layouts name rank 3"):
            transport.reshard(src, [None, None], scales)
    assert posted == ["batch_isend_irecv"]


def _failing_rank(rank: int, world: int, how: str, check: bool) -> Optional[str]:
    """Ranks 0-1 call with a 1 s deadline; rank 2 stalls past it, or dies, without calling
    (`dead`: maybe while the others post, maybe after; `dead-first`: before they post, so
    gloo refuses to post to it at once)."""
    spec = nr.TensorSpec("w", (4, 4), torch.float32, nr.Layout([2], 0, [nr.Shard(0)]), nr.Layout([2], 1, [nr.Replicate()]))
    plan = nr.Plan([spec], rank, nr.Config(mode="staged", timeout_ms=1000))
    # Each rank's gloo init has ended once it gets here; a rank that dies before another's
    # init has connected to it fails that init instead of the call under test.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"initialized-{rank}", "1")
    if rank == 2:
        if how.startswith("dead"):
            store.wait([f"initialized-{r}" for r in range(world)])
            os._exit(0)
        time.sleep(3)
        return None
    if how == "dead-first":
        time.sleep(0.5)
    transport = nr.TorchTransport(plan, check=check)
    start = time.monotonic()
    with pytest.raises(nr.RemoteError) as failure:
        transport.reshard([torch.ones(2, 4)], [torch.zeros(4, 4)] if rank == 1 else [None])
    took = time.monotonic() - start
    assert took < 3.0, took  # the deadline and a little, never the process group's 60 s
    return str(failure.value)


@pytest.mark.parametrize("how, check, stage", [
    ("stalled", True, r"the fingerprint exchange with peers \[2\] had not completed within its deadline of 1000 ms"),
    ("stalled", False, r"round 0 \(the rank's 1 of 1\) with peers \[2\] had not completed within its deadline of 1000 ms"),
    ("dead", False, r"round 0 \(the rank's 1 of 1\) with peers \[2\] failed; torch said: .*(reset|closed)"),
    ("dead-first", False, r"round 0 \(the rank's 1 of 1\) with peers \[2\] failed; torch said: .*(reset|closed)"),
], ids=["stalled-fingerprints", "stalled-round", "dead", "dead-before-posting"])
def test_a_stalled_or_dead_peer_ends_the_call_by_remote_error(how: str, check: bool, stage: str) -> None:
    dying = [2] if how.startswith("dead") else []
    results = run_world(3, _failing_rank, [(how, check)] * 3, barrier=False, dying=dying)
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: {stage}", results[rank]), results[rank]
        assert "Config(failed_ranks=...)" in results[rank]


def _mismatched_rank(rank: int, world: int) -> str:
    dtype = torch.float32 if rank == 0 else torch.int32  # rank 1 planned another tensor
    spec = nr.TensorSpec("w", (4, 4), dtype, nr.Layout([1], 0, [nr.Replicate()]), nr.Layout([1], 1, [nr.Replicate()]))
    plan = nr.Plan([spec], rank, nr.Config(mode="staged"))
    dst = [torch.full((4, 4), 7, dtype=dtype)] if rank == 1 else [None]
    with pytest.raises(nr.NcclReshardError, match="created its plan from different tensors or config") as failure:
        nr.TorchTransport(plan).reshard([torch.ones(4, 4, dtype=dtype)] if rank == 0 else [None], dst)
    if rank == 1:
        assert torch.equal(dst[0], torch.full((4, 4), 7, dtype=dtype))  # no data moved
    return str(failure.value)


def test_a_peer_that_planned_otherwise_is_caught_before_data_moves() -> None:
    results = run_world(2, _mismatched_rank, barrier=False)
    assert "rank 1 created its plan" in results[0] and "rank 0 created its plan" in results[1]
