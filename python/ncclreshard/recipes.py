"""Fused-parameter recipes: the global tensors inside a trainer's parameters (Megatron's
interleaved ``linear_qkv``, its gated ``linear_fc1``, GroupedMLP ``experts.weight1``/``weight2``;
separate HF-named parameters such as FSDP2's DTensors) and the inference engine's fused
parameters (vLLM/SGLang ``qkv_proj``, ``gate_up_proj``, FusedMoE ``w13_weight``/``w2_weight``),
as strided views on both sides, so a reshard lands every byte straight in the fused parameter
where the engine's ``weight_loader`` would put it — no temporary buffer, no ``load_weights``.

A recipe is a list of :class:`Piece`: one global tensor (a :class:`TensorSpec` whose layouts
carry the views' strides) and, per side, the parameter it lives in and how to take a rank's
view of it from that parameter's local tensor. The vLLM side follows the engines' loaders:
``qkv_proj`` holds this TP rank's q heads, then its k heads, then its v heads along
``output_dim`` 0 (k/v heads replicated when TP exceeds the KV heads); ``gate_up_proj`` its gate
rows then its up rows; ``w13_weight`` ``[experts, 2·ffn/tp, hidden]`` (gate then up along dim 1),
``w2_weight`` ``[experts, hidden, ffn/tp]`` sharded on ``input_dim``; with expert parallelism
every rank holds whole experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from .layout import Layout
from .placements import Replicate, Shard
from .spec import TensorSpec

ViewFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class View:
    """Where one side holds a global tensor: parameter `param`, and `take(local, rank)` the
    rank's view of it inside that parameter's local tensor."""

    param: str
    take: ViewFn


def whole(param: str) -> View:
    """The parameter's local tensor itself (a separate parameter, e.g. a DTensor's
    ``to_local()``)."""
    return View(param, lambda local, rank: local)


@dataclass(frozen=True)
class Piece:
    """One global tensor of a recipe and its view on each side."""

    spec: TensorSpec
    src: View
    dst: View


@dataclass(frozen=True)
class Recipe:
    """Pieces whose specs make one plan; :meth:`src_views`/:meth:`dst_views` give a rank's
    views in plan order from its parameters (None where the rank holds none)."""

    pieces: Tuple[Piece, ...]

    @property
    def specs(self) -> List[TensorSpec]:
        return [p.spec for p in self.pieces]

    def __add__(self, other: "Recipe") -> "Recipe":
        return Recipe(self.pieces + other.pieces)

    def _views(self, params: Mapping[str, torch.Tensor], rank: int, side: str) -> List[Optional[torch.Tensor]]:
        out: List[Optional[torch.Tensor]] = []
        for piece in self.pieces:
            view: View = getattr(piece, side)
            layout: Layout = getattr(piece.spec, side)
            if rank not in layout.ranks:
                out.append(None)
                continue
            if view.param not in params:
                raise ValueError(
                    f"{piece.spec.name}: rank {rank} holds a {side} view in parameter "
                    f"{view.param!r}, which params does not have"
                )
            local = params[view.param]
            local = local.to_local() if hasattr(local, "to_local") else local
            out.append(view.take(local, rank))
        return out

    def src_views(self, params: Mapping[str, torch.Tensor], rank: int) -> List[Optional[torch.Tensor]]:
        """The trainer-side views of `rank` (``src`` for :meth:`Plan.reshard`); DTensors are
        taken by their local tensor. ValueError when a needed parameter is missing."""
        return self._views(params, rank, "src")

    def dst_views(self, params: Mapping[str, torch.Tensor], rank: int) -> List[Optional[torch.Tensor]]:
        """The inference-side views of `rank` (``dst``). ValueError as :meth:`src_views`."""
        return self._views(params, rank, "dst")


def _even(total: int, parts: int, what: str) -> int:
    if parts <= 0 or total % parts:
        raise ValueError(f"{what} ({total}) must split evenly over {parts} ranks")
    return total // parts


def _tp(ranks: Sequence[int]) -> Layout:
    return Layout([len(ranks)], list(ranks), [Shard(0)])


def _vllm_kv(ranks: Sequence[int], num_kv_heads: int) -> Layout:
    """vLLM's k/v rows over TP: sharded by head, each head replicated when TP exceeds them."""
    p = len(ranks)
    if p <= num_kv_heads:
        _even(num_kv_heads, p, "num_kv_heads")
        return Layout([p], list(ranks), [Shard(0)])
    replicas = _even(p, num_kv_heads, "the inference TP size over num_kv_heads")
    return Layout([num_kv_heads, replicas], list(ranks), [Shard(0), Replicate()])


def _vllm_qkv_views(param: str, q_rows: int, kv_rows: int, kv_rows_local: int) -> Tuple[View, View, View]:
    q = View(param, lambda local, rank: local.narrow(0, 0, q_rows))
    k = View(param, lambda local, rank: local.narrow(0, q_rows, kv_rows_local))
    v = View(param, lambda local, rank: local.narrow(0, q_rows + kv_rows_local, kv_rows_local))
    return q, k, v


def hf_qkv_to_vllm(
    q: Tuple[str, Layout],
    k: Tuple[str, Layout],
    v: Tuple[str, Layout],
    dst_param: str,
    infer_ranks: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> Recipe:
    """Separate ``q_proj``/``k_proj``/``v_proj`` weights (each a parameter name and its layout,
    e.g. ``Layout.from_dtensor`` of an FSDP2 + TP DTensor) into vLLM's ``qkv_proj`` over the
    inference TP ranks `infer_ranks`. ValueError when the heads do not split over the TP size
    as vLLM requires."""
    p = len(infer_ranks)
    q_local = _even(num_heads, p, "num_heads") * head_dim
    kv_local = max(1, num_kv_heads // p) * head_dim
    views = _vllm_qkv_views(dst_param, q_local, num_kv_heads * head_dim, kv_local)
    pieces = []
    for (src_param, src_layout), rows, dst_layout, view, part in (
        (q, num_heads * head_dim, _tp(infer_ranks), views[0], "q"),
        (k, num_kv_heads * head_dim, _vllm_kv(infer_ranks, num_kv_heads), views[1], "k"),
        (v, num_kv_heads * head_dim, _vllm_kv(infer_ranks, num_kv_heads), views[2], "v"),
    ):
        spec = TensorSpec(f"{dst_param}.{part}", (rows, hidden_size), dtype, src_layout, dst_layout)
        pieces.append(Piece(spec, whole(src_param), view))
    return Recipe(tuple(pieces))


def megatron_qkv_to_vllm(
    src_param: str,
    dst_param: str,
    train_ranks: Sequence[int],
    infer_ranks: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> Recipe:
    """Megatron's ``linear_qkv`` (per query group: its q heads, then k, then v; TP over
    `train_ranks` by group) into vLLM's ``qkv_proj`` (TP over `infer_ranks`). The global
    tensors are q ``[groups, heads_per_group·head_dim, hidden]``, k and v
    ``[groups, head_dim, hidden]``; Megatron's views are strided (rows interleaved by group).
    ValueError when the groups or heads do not split as Megatron and vLLM require."""
    groups, t, p = num_kv_heads, len(train_ranks), len(infer_ranks)
    per_group = _even(num_heads, groups, "num_heads over num_kv_heads")
    _even(groups, t, "num_kv_heads (query groups) over the trainer TP size")
    _even(num_heads, p, "num_heads")
    group_rows = (per_group + 2) * head_dim
    train_strides = (group_rows * hidden_size, hidden_size, 1)

    def megatron(offset_heads: int, heads: int) -> View:
        def take(local: torch.Tensor, rank: int) -> torch.Tensor:
            grouped = local.view(-1, group_rows, hidden_size)
            return grouped.narrow(1, offset_heads * head_dim, heads * head_dim)
        return View(src_param, take)

    if p <= groups:
        _even(groups, p, "num_kv_heads over the inference TP size")
        q_dst = Layout([p], list(infer_ranks), [Shard(0)])
        kv_dst = q_dst
    else:
        replicas = _even(p, groups, "the inference TP size over num_kv_heads")
        _even(per_group, replicas, "heads per group over the TP ranks sharing a KV head")
        q_dst = Layout([groups, replicas], list(infer_ranks), [Shard(0), Shard(1)])
        kv_dst = Layout([groups, replicas], list(infer_ranks), [Shard(0), Replicate()])
    q_rows_local = num_heads // p * head_dim
    kv_local = max(1, groups // p) * head_dim
    q_view, k_view, v_view = _vllm_qkv_views(dst_param, q_rows_local, groups * head_dim, kv_local)

    def grouped(view: View, rows_per_group: int) -> View:
        def take(local: torch.Tensor, rank: int) -> torch.Tensor:
            return view.take(local, rank).view(-1, rows_per_group, hidden_size)
        return View(view.param, take)

    q_shape = (groups, per_group * head_dim, hidden_size)
    kv_shape = (groups, head_dim, hidden_size)
    train = Layout([t], list(train_ranks), [Shard(0)], train_strides)
    # A vLLM rank holds whole groups of q heads, or (TP past the groups) part of one.
    q_rows_per_group = per_group * head_dim if p <= groups else q_rows_local
    pieces = (
        Piece(TensorSpec(f"{dst_param}.q", q_shape, dtype, train, q_dst),
              megatron(0, per_group),
              grouped(q_view, q_rows_per_group)),
        Piece(TensorSpec(f"{dst_param}.k", kv_shape, dtype, train, kv_dst),
              megatron(per_group, 1), grouped(k_view, head_dim)),
        Piece(TensorSpec(f"{dst_param}.v", kv_shape, dtype, train, kv_dst),
              megatron(per_group + 1, 1), grouped(v_view, head_dim)),
    )
    return Recipe(pieces)


def _gate_up_dst(dst_param: str, infer_ranks: Sequence[int], ffn: int) -> Tuple[Layout, View, View]:
    rows = _even(ffn, len(infer_ranks), "the FFN size over the inference TP size")
    gate = View(dst_param, lambda local, rank: local.narrow(0, 0, rows))
    up = View(dst_param, lambda local, rank: local.narrow(0, rows, rows))
    return _tp(infer_ranks), gate, up


def megatron_fc1_to_vllm(
    src_param: str,
    dst_param: str,
    train_ranks: Sequence[int],
    infer_ranks: Sequence[int],
    *,
    ffn_hidden_size: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> Recipe:
    """Megatron's gated ``linear_fc1`` (each TP rank: its gate rows, then its up rows) into
    vLLM's ``gate_up_proj``; both halves are dense views (a pointer offset)."""
    rows = _even(ffn_hidden_size, len(train_ranks), "the FFN size over the trainer TP size")
    dst, gate_dst, up_dst = _gate_up_dst(dst_param, infer_ranks, ffn_hidden_size)
    shape = (ffn_hidden_size, hidden_size)
    return Recipe((
        Piece(TensorSpec(f"{dst_param}.gate", shape, dtype, _tp(train_ranks), dst),
              View(src_param, lambda local, rank: local.narrow(0, 0, rows)), gate_dst),
        Piece(TensorSpec(f"{dst_param}.up", shape, dtype, _tp(train_ranks), dst),
              View(src_param, lambda local, rank: local.narrow(0, rows, rows)), up_dst),
    ))


def hf_gate_up_to_vllm(
    gate: Tuple[str, Layout],
    up: Tuple[str, Layout],
    dst_param: str,
    infer_ranks: Sequence[int],
    *,
    ffn_hidden_size: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> Recipe:
    """Separate ``gate_proj``/``up_proj`` weights (name and layout each, e.g. FSDP2 DTensors)
    into vLLM's ``gate_up_proj``."""
    dst, gate_dst, up_dst = _gate_up_dst(dst_param, infer_ranks, ffn_hidden_size)
    shape = (ffn_hidden_size, hidden_size)
    return Recipe((
        Piece(TensorSpec(f"{dst_param}.gate", shape, dtype, gate[1], dst), whole(gate[0]), gate_dst),
        Piece(TensorSpec(f"{dst_param}.up", shape, dtype, up[1], dst), whole(up[0]), up_dst),
    ))


def megatron_experts_to_vllm(
    weight1: str,
    weight2: str,
    w13: str,
    w2: str,
    train_ranks: Sequence[int],
    infer_ranks: Sequence[int],
    *,
    num_experts: int,
    ffn_hidden_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    expert_parallel: bool = True,
) -> Recipe:
    """Megatron GroupedMLP experts (EP over `train_ranks`: ``experts.weight1``
    ``[hidden, local_experts·2·ffn]`` with each expert's gate then up columns, ``weight2``
    ``[local_experts·ffn, hidden]``) into vLLM FusedMoE ``w13_weight``/``w2_weight`` over
    `infer_ranks`: whole experts per rank with `expert_parallel`, else every expert on each rank
    with the FFN dim split (TP). Global tensors: gate and up ``[experts, ffn, hidden]``, down
    ``[experts, hidden, ffn]``; Megatron's views are transposed (strided) views."""
    e_train = _even(num_experts, len(train_ranks), "num_experts over the trainer EP size")
    ffn, hidden = ffn_hidden_size, hidden_size
    gate_up_train = Layout([len(train_ranks)], list(train_ranks), [Shard(0)],
                           (2 * ffn, 1, e_train * 2 * ffn))
    down_train = Layout([len(train_ranks)], list(train_ranks), [Shard(0)], (ffn * hidden, 1, hidden))

    def w1_half(which: int) -> View:
        def take(local: torch.Tensor, rank: int) -> torch.Tensor:
            return local.view(hidden, e_train, 2, ffn)[:, :, which, :].permute(1, 2, 0)
        return View(weight1, take)

    down_src = View(weight2, lambda local, rank: local.view(e_train, ffn, hidden).permute(0, 2, 1))
    p = len(infer_ranks)
    if expert_parallel:
        _even(num_experts, p, "num_experts over the inference EP size")
        half = ffn
        gate_up_dst = Layout([p], list(infer_ranks), [Shard(0)], (2 * ffn * hidden, hidden, 1))
        down_dst = Layout([p], list(infer_ranks), [Shard(0)])
    else:
        half = _even(ffn, p, "the expert FFN size over the inference TP size")
        gate_up_dst = Layout([p], list(infer_ranks), [Shard(1)], (2 * half * hidden, hidden, 1))
        down_dst = Layout([p], list(infer_ranks), [Shard(2)])
    gate_dst = View(w13, lambda local, rank: local.narrow(1, 0, half))
    up_dst = View(w13, lambda local, rank: local.narrow(1, half, half))
    gate_up = (num_experts, ffn, hidden)
    return Recipe((
        Piece(TensorSpec(f"{w13}.w1", gate_up, dtype, gate_up_train, gate_up_dst), w1_half(0), gate_dst),
        Piece(TensorSpec(f"{w13}.w3", gate_up, dtype, gate_up_train, gate_up_dst), w1_half(1), up_dst),
        Piece(TensorSpec(f"{w2}", (num_experts, hidden, ffn), dtype, down_train, down_dst),
              down_src, whole(w2)),
    ))
