"""Fused-parameter recipes: trainer parameters (Megatron's interleaved linear_qkv, gated
linear_fc1, GroupedMLP weight1/weight2; FSDP2 + TP DTensors of HF-named weights) resharded
into vLLM's fused parameters through the recipes' views must hold exactly what vLLM's
weight_loaders put there from the HF checkpoint. The loaders' rules are written out here,
independently of the recipes: narrow each HF weight along output_dim (input_dim for w2) by
the TP rank, k/v by tp_rank // replicas, and place it at its shard's offset in the fused
parameter. Runs on the host through every rank's exported transfers."""

from __future__ import annotations

from typing import Dict, Sequence

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import ncclreshard as nr
from ncclreshard import recipes
from conftest import fake_rank, run_transfers

HIDDEN, HEAD_DIM = 8, 2
DTYPE = torch.float32


def _hf(seed: int, **shapes: Sequence[int]) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*v, generator=g) for k, v in shapes.items()}


# --- vLLM's loaders (QKVParallelLinear, MergedColumnParallelLinear, FusedMoE), per TP rank ---

def vllm_qkv(w: Dict[str, torch.Tensor], heads: int, kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    q_rows = heads // tp * HEAD_DIM
    replicas = max(1, tp // kv_heads)
    kv_rows = max(1, kv_heads // tp) * HEAD_DIM
    kv_shard = rank // replicas
    return torch.cat([
        w["q_proj"].narrow(0, rank * q_rows, q_rows),
        w["k_proj"].narrow(0, kv_shard * kv_rows, kv_rows),
        w["v_proj"].narrow(0, kv_shard * kv_rows, kv_rows),
    ])


def vllm_gate_up(w: Dict[str, torch.Tensor], ffn: int, tp: int, rank: int) -> torch.Tensor:
    rows = ffn // tp
    return torch.cat([w["gate_proj"].narrow(0, rank * rows, rows), w["up_proj"].narrow(0, rank * rows, rows)])


def vllm_moe(w: Dict[str, torch.Tensor], experts: int, ffn: int, size: int, rank: int, ep: bool):
    if ep:
        ids = range(rank * experts // size, (rank + 1) * experts // size)
        rows, start = ffn, 0
    else:
        ids, rows, start = range(experts), ffn // size, rank * (ffn // size)
    w13 = torch.stack([torch.cat([w["w1"][e].narrow(0, start, rows), w["w3"][e].narrow(0, start, rows)]) for e in ids])
    w2 = torch.stack([w["w2"][e].narrow(1, start, rows) for e in ids])
    return w13, w2


# --- Megatron's parameter layouts, per TP/EP rank, from the HF weights ---

def megatron_qkv(w: Dict[str, torch.Tensor], heads: int, kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    per_group = heads // kv_heads
    groups = []
    for g in range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp):
        groups += [w["q_proj"].narrow(0, g * per_group * HEAD_DIM, per_group * HEAD_DIM),
                   w["k_proj"].narrow(0, g * HEAD_DIM, HEAD_DIM), w["v_proj"].narrow(0, g * HEAD_DIM, HEAD_DIM)]
    return torch.cat(groups)


def megatron_fc1(w: Dict[str, torch.Tensor], ffn: int, tp: int, rank: int) -> torch.Tensor:
    return vllm_gate_up(w, ffn, tp, rank)  # Megatron's gated fc1: the same per-rank gate | up


def megatron_grouped_mlp(w: Dict[str, torch.Tensor], experts: int, ep: int, rank: int):
    ids = range(rank * experts // ep, (rank + 1) * experts // ep)
    weight1 = torch.cat([torch.cat([w["w1"][e].t(), w["w3"][e].t()], dim=1) for e in ids], dim=1)
    weight2 = torch.cat([w["w2"][e].t() for e in ids], dim=0)
    return weight1.contiguous(), weight2.contiguous()


def _run(recipe: recipes.Recipe, train: Dict[int, Dict[str, torch.Tensor]],
         infer: Dict[int, Dict[str, torch.Tensor]], mode: str) -> None:
    ranks = sorted(set(train) | set(infer))
    plans = {r: nr.Plan(recipe.specs, r, nr.Config(mode=mode)) for r in ranks}
    src = {r: recipe.src_views(train.get(r, {}), r) for r in ranks}
    dst = {r: recipe.dst_views(infer.get(r, {}), r) for r in ranks}
    for r, plan in plans.items():
        for i, spec in enumerate(recipe.specs):
            for side, views in (("src", src[r]), ("dst", dst[r])):
                view = views[i]
                if view is not None:
                    # What Plan.reshard checks on a GPU, minus the device: shape and strides.
                    assert tuple(view.shape) == plan.local_shape(i, side), (spec.name, side, r)
                    layout = getattr(spec, side)
                    if layout.strides is None:
                        assert view.is_contiguous(), (spec.name, side, r)
                    else:
                        assert all(view.stride(d) == layout.strides[d] for d in range(view.dim()) if view.shape[d] > 1)
    run_transfers(plans, src, dst)
    for plan in plans.values():
        plan.close()


@pytest.mark.parametrize("heads, kv_heads, train_tp, infer_tp", [(8, 4, 2, 2), (8, 2, 2, 4), (8, 4, 4, 1), (4, 1, 1, 4)])
@pytest.mark.parametrize("mode", ["groupable", "auto"])
def test_megatron_qkv_lands_where_vllm_loads_it(heads, kv_heads, train_tp, infer_tp, mode) -> None:
    w = _hf(1, q_proj=(heads * HEAD_DIM, HIDDEN), k_proj=(kv_heads * HEAD_DIM, HIDDEN), v_proj=(kv_heads * HEAD_DIM, HIDDEN))
    train_ranks = list(range(train_tp))
    infer_ranks = list(range(train_tp, train_tp + infer_tp))[::-1]  # any rank order
    recipe = recipes.megatron_qkv_to_vllm(
        "decoder.layers.0.self_attention.linear_qkv.weight", "model.layers.0.self_attn.qkv_proj.weight",
        train_ranks, infer_ranks, num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM,
        hidden_size=HIDDEN, dtype=DTYPE)
    train = {r: {"decoder.layers.0.self_attention.linear_qkv.weight": megatron_qkv(w, heads, kv_heads, train_tp, i)}
             for i, r in enumerate(train_ranks)}
    expected = {r: vllm_qkv(w, heads, kv_heads, infer_tp, i) for i, r in enumerate(infer_ranks)}
    infer = {r: {"model.layers.0.self_attn.qkv_proj.weight": torch.full_like(e, float("nan"))} for r, e in expected.items()}
    _run(recipe, train, infer, mode)
    for r, e in expected.items():
        assert torch.equal(infer[r]["model.layers.0.self_attn.qkv_proj.weight"], e), r


@pytest.mark.parametrize("train_tp, infer_tp", [(2, 4), (4, 2), (1, 1)])
def test_megatron_fc1_lands_in_gate_up_proj(train_tp, infer_tp) -> None:
    ffn = 8
    w = _hf(2, gate_proj=(ffn, HIDDEN), up_proj=(ffn, HIDDEN))
    train_ranks, infer_ranks = list(range(train_tp)), list(range(2, 2 + infer_tp))  # colocated ranks too
    recipe = recipes.megatron_fc1_to_vllm("fc1", "gate_up_proj", train_ranks, infer_ranks,
                                          ffn_hidden_size=ffn, hidden_size=HIDDEN, dtype=DTYPE)
    train = {r: {"fc1": megatron_fc1(w, ffn, train_tp, i)} for i, r in enumerate(train_ranks)}
    expected = {r: vllm_gate_up(w, ffn, infer_tp, i) for i, r in enumerate(infer_ranks)}
    infer = {r: {"gate_up_proj": torch.zeros_like(e)} for r, e in expected.items()}
    _run(recipe, train, infer, "auto")
    for r, e in expected.items():
        assert torch.equal(infer[r]["gate_up_proj"], e), r


@pytest.mark.parametrize("ep_train, size, ep", [(2, 4, True), (4, 2, False), (2, 2, False), (1, 4, True)])
def test_megatron_grouped_mlp_lands_in_w13_and_w2(ep_train, size, ep) -> None:
    experts, ffn = 4, 4
    w = _hf(3, w1=(experts, ffn, HIDDEN), w3=(experts, ffn, HIDDEN), w2=(experts, HIDDEN, ffn))
    train_ranks, infer_ranks = list(range(ep_train)), list(range(4, 4 + size))
    recipe = recipes.megatron_experts_to_vllm(
        "experts.weight1", "experts.weight2", "experts.w13_weight", "experts.w2_weight",
        train_ranks, infer_ranks, num_experts=experts, ffn_hidden_size=ffn, hidden_size=HIDDEN,
        dtype=DTYPE, expert_parallel=ep)
    train = {}
    for i, r in enumerate(train_ranks):
        weight1, weight2 = megatron_grouped_mlp(w, experts, ep_train, i)
        train[r] = {"experts.weight1": weight1, "experts.weight2": weight2}
    expected = {r: vllm_moe(w, experts, ffn, size, i, ep) for i, r in enumerate(infer_ranks)}
    infer = {r: {"experts.w13_weight": torch.zeros_like(e[0]), "experts.w2_weight": torch.zeros_like(e[1])}
             for r, e in expected.items()}
    _run(recipe, train, infer, "staged")
    for r, (w13, w2) in expected.items():
        assert torch.equal(infer[r]["experts.w13_weight"], w13), r
        assert torch.equal(infer[r]["experts.w2_weight"], w2), r


def test_fsdp2_tp_dtensors_land_in_qkv_and_gate_up() -> None:
    """FSDP2 (dp 2) over TP 2 DTensors, as torch lays them out (_StridedShard + Shard), into
    vLLM TP 2: layouts from Layout.from_dtensor, local shards from torch itself."""
    heads, kv_heads, ffn = 4, 2, 6
    w = _hf(4, q_proj=(heads * HEAD_DIM, HIDDEN), k_proj=(kv_heads * HEAD_DIM, HIDDEN),
            v_proj=(kv_heads * HEAD_DIM, HIDDEN), gate_proj=(ffn, HIDDEN), up_proj=(ffn, HIDDEN))
    mesh_ranks = torch.tensor([[0, 1], [2, 3]])  # (dp, tp)
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    train: Dict[int, Dict[str, torch.Tensor]] = {}
    layouts: Dict[str, nr.Layout] = {}
    for rank in range(4):
        with fake_rank(rank, 6):
            mesh = DeviceMesh("cpu", mesh_ranks)
            train[rank] = {}
            for name, weight in w.items():
                dtensor = distribute_tensor(weight, mesh, placements, src_data_rank=None)
                train[rank][name] = dtensor.to_local()
                layouts[name] = nr.Layout.from_dtensor(dtensor)
    infer_ranks = [4, 5]
    recipe = recipes.hf_qkv_to_vllm(
        ("q_proj", layouts["q_proj"]), ("k_proj", layouts["k_proj"]), ("v_proj", layouts["v_proj"]),
        "qkv_proj", infer_ranks, num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM,
        hidden_size=HIDDEN, dtype=DTYPE,
    ) + recipes.hf_gate_up_to_vllm(
        ("gate_proj", layouts["gate_proj"]), ("up_proj", layouts["up_proj"]), "gate_up_proj",
        infer_ranks, ffn_hidden_size=ffn, hidden_size=HIDDEN, dtype=DTYPE)
    expected = {r: (vllm_qkv(w, heads, kv_heads, 2, i), vllm_gate_up(w, ffn, 2, i)) for i, r in enumerate(infer_ranks)}
    infer = {r: {"qkv_proj": torch.zeros_like(e[0]), "gate_up_proj": torch.zeros_like(e[1])} for r, e in expected.items()}
    _run(recipe, train, infer, "auto")
    for r, (qkv, gate_up) in expected.items():
        assert torch.equal(infer[r]["qkv_proj"], qkv), r
        assert torch.equal(infer[r]["gate_up_proj"], gate_up), r


def test_recipes_refuse_splits_the_engines_cannot_make() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads \(query groups\) over the trainer TP size"):
        recipes.megatron_qkv_to_vllm("a", "b", [0, 1, 2], [3], num_heads=8, num_kv_heads=4,
                                     head_dim=2, hidden_size=8, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"the FFN size over the inference TP size \(6\) must split evenly over 4 ranks"):
        recipes.megatron_fc1_to_vllm("a", "b", [0], [1, 2, 3, 4], ffn_hidden_size=6, hidden_size=8, dtype=DTYPE)
    recipe = recipes.megatron_fc1_to_vllm("fc1", "gate_up", [0], [1], ffn_hidden_size=4, hidden_size=8, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"rank 1 holds a dst view in parameter 'gate_up', which params does not have"):
        recipe.dst_views({}, 1)
