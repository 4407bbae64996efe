"""Where every checkpoint byte lands in a live vLLM model, derived from the model itself.

:func:`destination_pieces` walks one worker's ``named_parameters()`` and, for each parameter,
states which box of which Hugging Face checkpoint tensor it holds and where in the parameter
(a :class:`~ncclreshard.vllm.specs.DestinationPiece`), and which of its elements vLLM's loader
zeroes (the vocabulary's padding rows). It follows the loaders of vLLM 0.33
(docs/vllm-notes.md §4) from the layer types and their attributes:

- ``ReplicatedLinear`` and parameters without a loader of their own (norms): the whole tensor;
- ``ColumnParallelLinear``: rows of ``output_dim`` by TP rank; ``RowParallelLinear``: columns
  of ``input_dim`` (its bias whole);
- ``QKVParallelLinear``: this rank's q rows, then the rows of its KV head group
  (``tp_rank // num_kv_head_replicas``) of k and of v; ``MergedColumnParallelLinear``: each of
  ``output_sizes`` split by TP, one after another; the checkpoint names of the parts from the
  model's ``hf_to_vllm_mapper`` (its stacked entries), else its ``packed_modules_mapping``;
- ``VocabParallelEmbedding``/``ParallelLMHead``: checkpoint rows ``[org_vocab_start_index,
  org_vocab_end_index)`` at row 0, every later row of the shard zeroed;
- routed experts (``w13_weight``, ``w2_weight``): for each local expert, its gate/up rows and
  down columns of this rank's expert-TP slice, names and experts from the layer's own
  ``get_expert_mapping()`` and expert map (EP: only the rank's experts).

Every piece is a run of whole rows of a contiguous parameter, so it is one contiguous range
of it; the pieces and zeroed ranges of each parameter must tile it exactly (checked), so a
refit writes every byte of every parameter. A parameter no rule covers, or a quantized model,
raises :class:`~ncclreshard.vllm.specs.RefitError` naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .specs import Box, DestinationPiece, RefitError


@dataclass(frozen=True)
class ModelPieces:
    """One worker's pieces, the ranges of its parameters vLLM's loader zeroes
    (``(param, offset, count)``), and its parameters by name."""

    pieces: Tuple[DestinationPiece, ...]
    zeros: Tuple[Tuple[str, int, int], ...]
    params: Dict[str, torch.nn.Parameter]


def _whole(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def _rows(box_shape: Sequence[int], dim: int, start: int, count: int) -> Box:
    return tuple((start, start + count) if d == dim else (0, n) for d, n in enumerate(box_shape))


def _loader_name(param: Any) -> Optional[str]:
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        return None
    loader = getattr(loader, "func", loader)  # functools.partial
    return getattr(loader, "__qualname__", type(loader).__name__)


def _fused_parts(model: Any, module_path: str, count: int) -> List[Tuple[str, Any]]:
    """The checkpoint modules of a fused linear layer, with the loader's shard id of each:
    from the model's ``hf_to_vllm_mapper`` (stacked entries, what its ``load_weights`` maps
    by), else its ``packed_modules_mapping`` (q, k, v or 0, 1, … in order)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = getattr(mapper, "orig_to_new_stacked", None) or {}
    padded = f"{module_path}."
    found: Dict[Any, str] = {}
    for original, (fused, shard) in stacked.items():
        if padded.count(f"{fused}.") == 1:
            name = padded.replace(f"{fused}.", f"{original}.", 1)[:-1]
            if found.setdefault(shard, name) != name:
                found = {}
                break
    if found:
        order = {"q": 0, "k": 1, "v": 2}
        return [(found[s], s) for s in sorted(found, key=lambda s: order.get(s, s))]
    packed = getattr(model, "packed_modules_mapping", None) or {}
    parts = packed.get(module_path.rsplit(".", 1)[-1])
    if parts and len(parts) == count:
        parent = module_path.rsplit(".", 1)[0]
        ids: Sequence[Any] = ("q", "k", "v") if count == 3 else range(count)
        return [(f"{parent}.{p}", i) for p, i in zip(parts, ids)]
    return []


class _Walker:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.pieces: List[DestinationPiece] = []
        self.zeros: List[Tuple[str, int, int]] = []

    def piece(self, name: str, shape: Sequence[int], param_name: str, param: torch.Tensor,
              box: Box, offset: int) -> None:
        self.pieces.append(DestinationPiece(name, tuple(int(n) for n in shape), param.dtype,
                                            param_name, box, offset))

    def refuse(self, param_name: str, module: Any, param: Any, why: str) -> RefitError:
        return RefitError(
            f"vLLM parameter {param_name} ({type(module).__name__}, loader "
            f"{_loader_name(param) or 'none'}, shape {list(param.shape)}): {why}"
        )

    # -- layer kinds ------------------------------------------------------------------------

    def whole(self, name: str, param_name: str, param: torch.Tensor) -> None:
        self.piece(name, param.shape, param_name, param, _whole(param.shape), 0)

    def sharded(self, name: str, param_name: str, param: torch.Tensor, dim: int, rank: int,
                size: int) -> None:
        shape = list(param.shape)
        local = shape[dim]
        shape[dim] = local * size
        self.piece(name, shape, param_name, param, _rows(shape, dim, rank * local, local), 0)

    def fused(self, module_path: str, leaf: str, param_name: str, param: torch.Tensor,
              module: Any, parts: Sequence[Tuple[int, int, int]]) -> None:
        """Rows [start, start + count) of the checkpoint part i at local row `at`, per part:
        `parts` is (global rows of the part, start, count) in the fused order."""
        dim = getattr(param, "output_dim", None)
        if dim != 0:
            raise self.refuse(param_name, module, param, f"fused along output_dim {dim}, not 0")
        names = _fused_parts(self.model, module_path, len(parts))
        if len(names) != len(parts):
            raise self.refuse(
                param_name, module, param,
                f"the model maps {len(names)} checkpoint tensors into it (hf_to_vllm_mapper or "
                f"packed_modules_mapping) but the layer has {len(parts)} parts",
            )
        row = math.prod(param.shape[1:])
        at = 0
        for (part, _), (rows, start, count) in zip(names, parts):
            shape = (rows,) + tuple(param.shape[1:])
            self.piece(f"{part}.{leaf}", shape, param_name, param, _rows(shape, 0, start, count),
                       at * row)
            at += count
        if at != param.shape[0]:
            raise self.refuse(param_name, module, param,
                              f"its parts hold {at} rows, the parameter {param.shape[0]}")

    def qkv(self, module_path: str, leaf: str, param_name: str, param: torch.Tensor, m: Any) -> None:
        group = m.tp_rank // m.num_kv_head_replicas
        q, k, v = (m.num_heads * m.head_size, m.num_kv_heads * m.head_size,
                   m.num_kv_heads * m.v_head_size)
        self.fused(module_path, leaf, param_name, param, m, [
            (m.total_num_heads * m.head_size, m.tp_rank * q, q),
            (m.total_num_kv_heads * m.head_size, group * k, k),
            (m.total_num_kv_heads * m.v_head_size, group * v, v),
        ])

    def merged(self, module_path: str, leaf: str, param_name: str, param: torch.Tensor, m: Any) -> None:
        parts = []
        for size in m.output_sizes:
            local = size // m.tp_size
            parts.append((size, m.tp_rank * local, local))
        self.fused(module_path, leaf, param_name, param, m, parts)

    def vocab(self, param_name: str, param: torch.Tensor, m: Any) -> None:
        if getattr(param, "output_dim", None) is None:
            self.whole(param_name, param_name, param)
            return
        if param.output_dim != 0 or getattr(param, "packed_dim", None) is not None:
            raise self.refuse(param_name, m, param, "a vocabulary sharded other than by rows")
        indices = m.shard_indices
        start, end = indices.org_vocab_start_index, indices.org_vocab_end_index
        shape = (m.org_vocab_size,) + tuple(param.shape[1:])
        row = math.prod(param.shape[1:])
        self.piece(param_name, shape, param_name, param, _rows(shape, 0, start, end - start), 0)
        # vLLM's loader zeroes the rest of the shard (vocabulary padding, added tokens).
        rest = param.shape[0] - (end - start)
        if rest:
            self.zeros.append((param_name, (end - start) * row, rest * row))

    def experts(self, param_name: str, leaf: str, param: torch.Tensor, m: Any) -> None:
        config = m.moe_config
        if config.num_experts != config.num_logical_experts:
            raise self.refuse(param_name, m, param,
                              "redundant experts (EPLB) are not supported by this backend")
        layer = m.layer_name
        if not layer.endswith("experts"):
            raise self.refuse(param_name, m, param, f"layer name {layer!r} does not end in 'experts'")
        parallel = config.moe_parallel_config
        t, tp = parallel.tp_rank, parallel.tp_size
        gated = bool(config.is_act_and_mul)
        held = 0
        for prefix, weight_name, expert, shard in m.get_expert_mapping():
            kind = prefix.rsplit(".", 1)[-1]  # "w13_" / "w2_"
            if not leaf.startswith(kind) or not weight_name.startswith("experts."):
                continue
            local = m.expert_map_manager.map_global_to_local(expert)
            if local < 0:
                continue  # another EP rank's expert
            name = f"{layer[: -len('experts')]}{weight_name}{leaf[len(kind):]}"
            per = param[local]
            base = local * per.numel()
            if shard in ("w1", "w3"):
                rows = per.shape[0] // (2 if gated else 1)
                at = 0 if shard == "w1" else rows
                shape = (rows * tp,) + tuple(per.shape[1:])
                box = _rows(shape, 0, t * rows, rows)
                self.piece(name, shape, param_name, param, box, base + at * math.prod(per.shape[1:]))
            elif shard == "w2":
                cols = per.shape[1]
                shape = (per.shape[0], cols * tp) + tuple(per.shape[2:])
                self.piece(name, shape, param_name, param, _rows(shape, 1, t * cols, cols), base)
            else:
                raise self.refuse(param_name, m, param, f"expert shard id {shard!r}")
            held += 1
        if not held and param.numel():
            raise self.refuse(param_name, m, param, "no expert of the layer's mapping lands in it")


def destination_pieces(model: Any, vllm_config: Any = None) -> ModelPieces:
    """Every checkpoint piece this worker's live `model` holds (see the module doc), with the
    ranges its loader zeroes. Raises RefitError naming the first parameter it cannot place,
    and for quantized models (`vllm_config.model_config.quantization` set)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    model_config = getattr(vllm_config, "model_config", None)
    quantization = getattr(model_config, "quantization", None)
    if quantization is not None:
        raise RefitError(
            f"the model is quantized ({quantization}); this backend writes bf16/fp16/fp32 "
            "parameters only (FP8 block-quantized models: python/README.md, 'From vLLM')"
        )
    owners: Dict[int, Tuple[str, Any]] = {}
    for module_name, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (module_name, module))
    walker = _Walker(model)
    params: Dict[str, torch.nn.Parameter] = {}
    for param_name, param in model.named_parameters():
        params[param_name] = param
        module_path, module = owners[id(param)]
        leaf = param_name.rsplit(".", 1)[-1]
        if not param.data.is_contiguous():
            raise walker.refuse(param_name, module, param, "not contiguous")
        if param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise walker.refuse(param_name, module, param, f"dtype {param.dtype}")
        for flag in ("packed_dim", "packed_factor", "is_sharded_weight", "needs_scalar_to_array"):
            if getattr(param, flag, None):
                raise walker.refuse(param_name, module, param, f"the loader flag {flag} is set")
        loader = getattr(param, "weight_loader", None)
        loader = getattr(loader, "func", loader)
        if isinstance(module, RoutedExperts) and leaf in ("w13_weight", "w2_weight"):
            walker.experts(param_name, leaf, param, module)
        elif isinstance(module, QKVParallelLinear):
            walker.qkv(module_path, leaf, param_name, param, module)
        elif isinstance(module, MergedColumnParallelLinear):
            walker.merged(module_path, leaf, param_name, param, module)
        elif isinstance(module, ColumnParallelLinear):
            dim = getattr(param, "output_dim", None)
            if dim is None:
                walker.whole(param_name, param_name, param)
            else:
                walker.sharded(param_name, param_name, param, dim, module.tp_rank, module.tp_size)
        elif isinstance(module, RowParallelLinear):
            dim = getattr(param, "input_dim", None)
            if dim is None:
                walker.whole(param_name, param_name, param)
            else:
                walker.sharded(param_name, param_name, param, dim, module.tp_rank, module.tp_size)
        elif isinstance(module, ReplicatedLinear):
            walker.whole(param_name, param_name, param)
        elif isinstance(module, VocabParallelEmbedding):
            walker.vocab(param_name, param, module)
        elif loader is None or loader is default_weight_loader:
            walker.whole(param_name, param_name, param)
        else:
            raise walker.refuse(param_name, module, param, "no layout rule for this layer and loader")

    ranges: Dict[str, List[Tuple[int, int, str]]] = {}
    for p in walker.pieces:
        ranges.setdefault(p.param, []).append((p.offset, p.numel, p.name))
    for param_name, offset, count in walker.zeros:
        ranges.setdefault(param_name, []).append((offset, count, "zeros"))
    for param_name, param in params.items():
        at = 0
        for offset, count, what in sorted(ranges.get(param_name, [])):
            if offset != at:
                raise RefitError(
                    f"vLLM parameter {param_name}: elements [{at}, {offset}) are written by no "
                    f"checkpoint tensor (next: {what})" if offset > at else
                    f"vLLM parameter {param_name}: {what} overlaps another piece at element {offset}"
                )
            at += count
        if at != param.numel():
            raise RefitError(
                f"vLLM parameter {param_name}: its pieces cover {at} of {param.numel()} elements"
            )
    return ModelPieces(tuple(walker.pieces), tuple(walker.zeros), params)
