"""The vLLM backend's planning without vLLM (ncclreshard.vllm.specs): destination layouts
inferred from the boxes workers hold, checked here against boxes written out by hand from
vLLM's loaders (docs/vllm-notes.md §4), and every refusal of ``build`` naming the tensor and
the vLLM parameter. The plugin entry point installed with the package, and its hook doing
nothing without vLLM. Runs in both venvs (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

import ncclreshard as nr
from ncclreshard.vllm.specs import (
    Declaration,
    DestinationPiece,
    RefitError,
    SourceTensor,
    build,
    layout_from_boxes,
)

BF16 = torch.bfloat16


def _boxes_held(layout: nr.Layout, shape, ranks):
    out = {}
    for r in ranks:
        runs = nr.local_runs(layout, shape, r)
        out[r] = tuple((d[0][0], d[-1][1]) if d else (0, 0) for d in runs)
    return out


@pytest.mark.parametrize("shape, boxes, mesh, placements", [
    # Row-parallel o_proj at TP 2: columns by rank.
    ((64, 128), {4: ((0, 64), (0, 64)), 5: ((0, 64), (64, 128))}, (2,), (nr.Shard(1),)),
    # k_proj at TP 4 with 2 KV heads of 16 rows: two ranks per head.
    ((32, 64), {4: ((0, 16), (0, 64)), 5: ((0, 16), (0, 64)), 6: ((16, 32), (0, 64)), 7: ((16, 32), (0, 64))},
     (2, 2), (nr.Shard(0), nr.Replicate())),
    # The vocabulary: 1100 rows padded to 1152, blocks of 288 rows at TP 4 (not torch.chunk's 275).
    ((1100, 64), {4: ((0, 288), (0, 64)), 5: ((288, 576), (0, 64)), 6: ((576, 864), (0, 64)), 7: ((864, 1100), (0, 64))},
     (4,), (nr.ShardBlocks(0, 288),)),
    # An expert under EP: one owner holds it whole.
    ((32, 64), {6: ((0, 32), (0, 64))}, (1,), (nr.Replicate(),)),
    # A norm on every worker.
    ((64,), {4: ((0, 64),), 5: ((0, 64),), 6: ((0, 64),)}, (3,), (nr.Replicate(),)),
    # DP 2 x TP 2 column-parallel rows: the replicas of each shard on the last axis.
    ((8, 4), {4: ((0, 4), (0, 4)), 5: ((4, 8), (0, 4)), 6: ((0, 4), (0, 4)), 7: ((4, 8), (0, 4))},
     (2, 2), (nr.Shard(0), nr.Replicate())),
])
def test_layouts_from_the_boxes_vllm_ranks_hold(shape, boxes, mesh, placements) -> None:
    layout = layout_from_boxes("t", shape, boxes)
    assert layout.mesh_shape == mesh and layout.placements == placements, layout
    assert _boxes_held(layout, shape, boxes) == boxes


def test_boxes_no_layout_gives_are_refused() -> None:
    with pytest.raises(RefitError, match=r"t: vLLM's workers hold boxes .* which no mesh of shards and replicas"):
        layout_from_boxes("t", (8,), {0: ((0, 4),), 1: ((4, 8),), 2: ((0, 4),)})
    with pytest.raises(RefitError, match=r"neither Shard nor ShardBlocks gives them"):
        layout_from_boxes("t", (10,), {0: ((0, 2),), 1: ((2, 10),)})


def _worker(rank, *pieces):
    return Declaration(rank, "worker", pieces=tuple(pieces))


def _piece(name, shape, param, box, dtype=BF16, offset=0):
    return DestinationPiece(name, shape, dtype, param, box, offset)


def _trainer(rank, *sources):
    return Declaration(rank, "trainer", sources=tuple(sources))


ROW = nr.Layout([2], [0, 1], [nr.Shard(0)])


def _o_proj_workers():
    return [_worker(2, _piece("o", (4, 8), "o_proj", ((0, 4), (0, 4)))),
            _worker(3, _piece("o", (4, 8), "o_proj", ((0, 4), (4, 8))))]


def test_build_plans_every_tensor_from_all_declarations() -> None:
    refit = build([_trainer(0, SourceTensor("o", (4, 8), BF16, ROW)),
                   _trainer(1, SourceTensor("o", (4, 8), BF16, ROW))] + _o_proj_workers())
    (spec,) = refit.specs
    assert spec.dst == nr.Layout([2], [2, 3], [nr.Shard(1)])
    assert set(refit.pieces[0]) == {2, 3}
    with pytest.raises(RefitError, match=r"'x' is not among the tensors declared"):
        refit.subset(["x"])


def test_replicas_on_disjoint_meshes_are_one_source() -> None:
    """FSDP2 + TP: a parameter TP leaves whole is a DTensor on each TP rank's own DP mesh."""
    a = SourceTensor("o", (4, 8), BF16, nr.Layout([2], [0, 2], [nr.Shard(0)]))
    b = SourceTensor("o", (4, 8), BF16, nr.Layout([2], [1, 3], [nr.Shard(0)]))
    refit = build([_trainer(0, a), _trainer(1, b), _trainer(2, a), _trainer(3, b)]
                  + [_worker(4, _piece("o", (4, 8), "o_proj", ((0, 4), (0, 8))))])
    assert refit.specs[0].src == nr.Layout([2, 2], [0, 2, 1, 3], [nr.Replicate(), nr.Shard(0)])


def test_a_split_first_dim_maps_the_workers_rows_into_groups() -> None:
    """Megatron's interleaved q: [groups, rows per group, hidden] over vLLM's [rows, hidden]."""
    q = SourceTensor("q", (2, 8, 4), BF16, nr.Layout([2], [0, 1], [nr.Shard(0)]))
    workers = [_worker(2 + r, _piece("q", (16, 4), "qkv_proj", ((4 * r, 4 * r + 4), (0, 4)))) for r in range(4)]
    refit = build([_trainer(0, q), _trainer(1, q)] + workers)
    assert refit.specs[0].dst == nr.Layout([2, 2], [2, 3, 4, 5], [nr.Shard(0), nr.Shard(1)])
    cut = [_worker(2, _piece("q", (16, 4), "qkv_proj", ((0, 12), (0, 4)))),
           _worker(3, _piece("q", (16, 4), "qkv_proj", ((12, 16), (0, 4))))]
    with pytest.raises(RefitError, match=r"q: the trainer declares it as \[2, 8, 4\], groups of 8 rows, but "
                                         r"vLLM's qkv_proj on rank 2 holds rows \[0, 12\), which cut a group"):
        build([_trainer(0, q), _trainer(1, q)] + cut)


@pytest.mark.parametrize("declarations, message", [
    ([_trainer(0, SourceTensor("o", (4, 8), BF16, ROW), SourceTensor("x", (2,), BF16, ROW))] + _o_proj_workers(),
     r"x: the trainer sends it but the vLLM model has no parameter for it"),
    ([_trainer(0)] + _o_proj_workers(), r"o: vLLM's parameter o_proj needs this checkpoint tensor and no trainer sends it"),
    ([_trainer(0, SourceTensor("o", (4, 6), BF16, ROW))] + _o_proj_workers(),
     r"o: the trainer declares shape \[4, 6\] but vLLM's o_proj takes \[4, 8\]"),
    ([_trainer(0, SourceTensor("o", (4, 8), torch.float32, ROW))] + _o_proj_workers(),
     r"o: the trainer sends torch.float32 but vLLM's o_proj is torch.bfloat16"),
    ([_trainer(0, SourceTensor("o", (4, 8), BF16, ROW)), _trainer(1, SourceTensor("o", (4, 8), BF16, nr.Layout([2], [0, 1], [nr.Shard(1)])))]
     + _o_proj_workers(), r"o: trainer ranks declare it differently"),
    ([_trainer(0, SourceTensor("o", (4, 8), BF16, ROW)), Declaration(1, "trainer", error="no DTensor for o")]
     + _o_proj_workers(), r"rank 1 \(trainer\): no DTensor for o"),
    ([_trainer(0, SourceTensor("o", (4, 8), BF16, ROW)), _worker(2, _piece("o", (4, 8), "a", ((0, 4), (0, 8))),
                                                                 _piece("o", (4, 8), "b", ((0, 4), (0, 8))))],
     r"o: vLLM rank 2 holds it in two parameters \(a and b\)"),
], ids=["unknown", "missing", "shape", "dtype", "trainers-disagree", "rank-error", "twice"])
def test_build_refuses_naming_the_tensor_and_parameter(declarations, message) -> None:
    with pytest.raises(RefitError, match=message):
        build(declarations)


FP8 = torch.float8_e4m3fn


def _fp8_workers(scale_ranks=(2, 3), block=(2, 2), grid_rows=2):
    """q of [4, 8] column-parallel at TP 2 in FP8 2 x 2 blocks (each rank 2 rows: one row of
    blocks) and its scales, [2, 4], in `grid_rows` rows of the parameter `q_scale`."""
    workers = []
    for r in (2, 3):
        pieces = [DestinationPiece("q", (4, 8), FP8, "q_w", ((2 * (r - 2), 2 * (r - 1)), (0, 8)), 0,
                                   block=block)]
        if r in scale_ranks:
            pieces.append(DestinationPiece("q_scale_inv", (grid_rows, 4), torch.float32, "q_scale",
                                           ((r - 2, r - 1), (0, 4)), 0, scale_of="q"))
        workers.append(_worker(r, *pieces))
    return workers


def test_an_fp8_destination_is_quantized_on_the_way_with_its_scales_laid_out_as_held() -> None:
    """vLLM's FP8 block weight: the trainer's bf16 tensor becomes a block-quantized spec whose
    scale layout comes from the workers' scale pieces (a row of blocks per rank)."""
    src = SourceTensor("q", (4, 8), BF16, ROW)
    refit = build([_trainer(0, src), _trainer(1, src)] + _fp8_workers())
    (spec,) = refit.specs
    assert spec.dst_dtype == FP8 and spec.dst == nr.Layout([2], [2, 3], [nr.Shard(0)])
    assert spec.quant == nr.Quant("block", block=(2, 2), scale_layout=nr.Layout([2], [2, 3], [nr.Shard(0)]))
    assert {r: p.param for r, p in refit.scales[0].items()} == {2: "q_scale", 3: "q_scale"}
    assert refit.subset(["q"]).scales == refit.scales
    plan = nr.Plan(list(refit.specs), 2)
    try:
        (view,) = plan.scale_views()
        assert view.shape == (2, 4) and view.local_shape == (1, 4)
    finally:
        plan.close()


def test_an_fp8_destination_from_a_split_source_keeps_whole_blocks() -> None:
    """Megatron's [groups, rows per group, hidden] view of an FP8 weight: blocks and scales map
    group by group when a group is whole blocks; otherwise refused."""
    src = SourceTensor("q", (2, 2, 8), BF16, nr.Layout([2], [0, 1], [nr.Shard(0)]))
    refit = build([_trainer(0, src), _trainer(1, src)] + _fp8_workers())
    assert refit.specs[0].quant.scale_layout == nr.Layout([2], [2, 3], [nr.Shard(0)])
    assert refit.specs[0].quant.scale_shape(src.shape) == (2, 1, 4)
    odd = SourceTensor("q", (4, 1, 8), BF16, nr.Layout([2], [0, 1], [nr.Shard(0)]))
    with pytest.raises(RefitError, match=r"q: the trainer declares it as \[4, 1, 8\], groups of 1 rows, "
                                         r"which cut vLLM's 2-row FP8 blocks"):
        build([_trainer(0, odd), _trainer(1, odd)] + _fp8_workers())


@pytest.mark.parametrize("declarations, message", [
    ([_trainer(0, SourceTensor("q", (4, 8), FP8, ROW))] + _fp8_workers(),
     r"q: the trainer sends torch.float8_e4m3fn; vLLM's q_w is torch.float8_e4m3fn in blocks, "
     r"quantized on the way from bfloat16, float16 or float32 only"),
    ([_trainer(0, SourceTensor("q", (4, 8), BF16, ROW))] + _fp8_workers(scale_ranks=(2,)),
     r"q: vLLM ranks \[2, 3\] hold its FP8 values but ranks \[2\] its scales"),
    ([_trainer(0, SourceTensor("q", (4, 8), BF16, ROW))] + _fp8_workers(grid_rows=3),
     r"q: vLLM's q_scale holds a scale grid of \[3, 4\], not the \[2, 4\] of \[4, 8\] in 2 x 2 blocks"),
    ([_trainer(0, SourceTensor("q", (4, 8), BF16, ROW))]
     + [_worker(2, DestinationPiece("q_scale_inv", (2, 4), torch.float32, "q_scale", ((0, 2), (0, 4)), 0,
                                    scale_of="q"))],
     r"q: vLLM's q_scale holds its scales but no rank its values"),
    ([_trainer(0, SourceTensor("q", (4, 8), BF16, ROW), SourceTensor("q_scale_inv", (2, 4), torch.float32, ROW))]
     + _fp8_workers(),
     r"q_scale_inv: the trainer sends FP8 scales, but vLLM's q_scale gets the block scales of q computed "
     r"on the way"),
], ids=["fp8-source", "scales-elsewhere", "refined-grid", "scales-only", "scales-sent"])
def test_fp8_destinations_refuse_naming_the_tensor_and_parameter(declarations, message) -> None:
    with pytest.raises(RefitError, match=message):
        build(declarations)


def test_declarations_travel_as_json() -> None:
    d = Declaration(3, "worker", pieces=(_piece("q", (16, 4), "qkv_proj", ((4, 8), (0, 4)), offset=16),),
                    error=None)
    assert Declaration.from_json(d.to_json()) == d
    for w in _fp8_workers():
        assert Declaration.from_json(w.to_json()) == w
    t = _trainer(0, SourceTensor("o", (4, 8), BF16, nr.Layout([2], [0, 1], [nr.ShardBlocks(0, 3)], (8, 1))))
    assert Declaration.from_json(t.to_json()) == t


def test_the_plugin_entry_point_is_installed() -> None:
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ncclreshard"]
    assert [e.value for e in found] == ["ncclreshard.vllm:register"]


def test_the_plugin_does_nothing_without_vllm() -> None:
    """vLLM absent (its factory module unimportable): the hook returns, twice, raising nothing."""
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['vllm.distributed.weight_transfer.factory'] = None\n"
        "from ncclreshard.vllm import register; register(); register(); print('quiet')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "quiet", done.stderr
