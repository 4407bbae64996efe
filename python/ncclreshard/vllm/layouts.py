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

FP8 block-quantized models (vLLM's ``fp8`` method with ``weight_block_size``, DeepSeek-V3's
checkpoint format): a linear layer's or the experts' ``weight`` is float8_e4m3fn, placed by the
rules above, and its pieces carry the block; its ``weight_scale_inv`` (one float32 multiplier
per block) gets the same pieces over the block grid (``scale_of`` the weight's checkpoint name),
which requires every piece to start and end on a block boundary (or the tensor's end). KV-cache
scales (``attn.k_scale``, …) are not in such a checkpoint: they are kept as the model has them.

Every piece is a run of whole rows of a contiguous parameter, so it is one contiguous range
of it; the pieces and zeroed ranges of each parameter must tile it exactly (checked), so a
refit writes every byte of every parameter it does not keep. A parameter no rule covers, or a
quantization other than FP8 blocks, raises :class:`~ncclreshard.vllm.specs.RefitError` naming
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..spec import Quant
from .specs import SCALE_SUFFIX, Box, DestinationPiece, RefitError


@dataclass(frozen=True)
class ModelPieces:
    """One worker's pieces, the ranges of its parameters vLLM's loader zeroes
    (``(param, offset, count)``), its parameters by name, and those a refit keeps as they are
    (no checkpoint tensor writes them: an FP8 model's KV-cache scales)."""

    pieces: Tuple[DestinationPiece, ...]
    zeros: Tuple[Tuple[str, int, int], ...]
    params: Dict[str, torch.nn.Parameter]
    kept: Tuple[str, ...] = ()


_FP8 = (torch.float8_e4m3fn,)
_KV_CACHE_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")
# vLLM's FP8 MoE backends whose post-load conversion leaves the loaded values and scales as they
# are (`convert_to_fp8_moe_kernel_format`'s fall-through); NONE: no kernel converted them.
_FP8_MOE_KEEPS_LOADED = ("TRITON", "BATCHED_TRITON", "VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS", "NONE")


def _fp8_kernel_change(module: Any) -> Optional[str]:
    """What vLLM's FP8 kernel of `module` does to the loaded weight and scales after loading
    that an in-place refit would have to redo (None: it keeps them as loaded): a block linear
    kernel that overrides the base class's post-load step (DeepGEMM re-lays out scales and on
    Blackwell re-quantizes them to UE8M0; vLLM's CPU kernels prepack; Marlin repacks), or an
    MoE backend that converts experts (DeepGEMM, FlashInfer, Marlin, AITER, CPU)."""
    method = getattr(module, "quant_method", None)
    backend = getattr(method, "fp8_backend", None)
    if backend is not None:
        name = getattr(backend, "value", str(backend))
        if name not in _FP8_MOE_KEEPS_LOADED:
            return f"vLLM's FP8 MoE backend {name} converts the experts after loading"
        return None
    if getattr(method, "use_marlin", False):
        return "vLLM's Marlin FP8 kernel repacks the weight after loading"
    kernel = getattr(method, "fp8_linear", None)
    if kernel is None:
        return None
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )

    base = Fp8BlockScaledMMLinearKernel.process_weights_after_loading
    if getattr(type(kernel), "process_weights_after_loading", base) is not base:
        return f"vLLM's FP8 kernel {type(kernel).__name__} transforms the weight or scales after loading"
    return None


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

    def scales(self, param_name: str, param: torch.Tensor, module: Any,
               weight_name: str, weight: torch.Tensor) -> None:
        """The block scales `param` of the FP8 `weight`: each of the weight's pieces over the
        block grid (leading dims as they are, rows and columns in blocks), the weight's pieces
        marked with the block."""
        block = getattr(module, "weight_block_size", None)
        if not block or len(block) != 2:
            raise self.refuse(param_name, module, param,
                              "an FP8 scale without a block size (per-tensor FP8 is not supported)")
        bn, bk = int(block[0]), int(block[1])
        quant = Quant("block", block=(bn, bk))
        grid = quant.scale_shape(weight.shape)
        if tuple(param.shape) != grid:
            raise self.refuse(
                param_name, module, param,
                f"its shape is not the block grid {list(grid)} of {weight_name} "
                f"{list(weight.shape)} in {bn} x {bk} blocks (vLLM refines MoE scale grids "
                "whose shards cut blocks: give each rank whole blocks)",
            )
        rows, cols = weight.shape[-2], weight.shape[-1]
        for i, piece in enumerate(self.pieces):
            if piece.param != weight_name:
                continue
            if len(piece.shape) < 2:
                raise self.refuse(param_name, module, param, f"{piece.name} is not a matrix")
            edges = []
            sizes = quant.block_shape(piece.shape)
            for d, ((a, b), n, size) in enumerate(zip(piece.box, piece.shape, sizes)):
                if a % size or (b % size and b != n):
                    raise self.refuse(
                        param_name, module, param,
                        f"{piece.name}'s rows/columns [{a}, {b}) along dim {d} cut its "
                        f"{bn} x {bk} blocks; a rank must hold whole blocks",
                    )
                edges.append((a // size, -(-b // size)))
            row = piece.offset // cols
            lead, r = divmod(row, rows)
            if piece.offset % cols or r % bn:
                raise self.refuse(param_name, module, param,
                                  f"{piece.name} starts inside a block of {weight_name}")
            offset = (lead * grid[-2] + r // bn) * grid[-1]
            shape = quant.scale_shape(piece.shape)
            self.pieces[i] = DestinationPiece(piece.name, piece.shape, piece.dtype, piece.param,
                                              piece.box, piece.offset, block=(bn, bk))
            self.pieces.append(DestinationPiece(
                piece.name + SCALE_SUFFIX, shape, param.dtype, param_name, tuple(edges), offset,
                scale_of=piece.name,
            ))


def destination_pieces(model: Any, vllm_config: Any = None) -> ModelPieces:
    """Every checkpoint piece this worker's live `model` holds (see the module doc), with the
    ranges its loader zeroes and the parameters a refit keeps. Raises RefitError naming the
    first parameter it cannot place, and for a quantization other than FP8 blocks
    (`vllm_config.model_config.quantization`, `vllm_config.quant_config.weight_block_size`)."""
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
    block = getattr(getattr(vllm_config, "quant_config", None), "weight_block_size", None)
    if quantization is not None and (quantization != "fp8" or not block):
        raise RefitError(
            f"the model is quantized ({quantization}"
            f"{'' if quantization != 'fp8' else ' per tensor'}); this backend writes "
            "bf16/fp16/fp32 parameters and FP8 block-quantized ones (quantization 'fp8' with "
            "weight_block_size) only"
        )
    fp8 = quantization is not None
    owners: Dict[int, Tuple[str, Any]] = {}
    for module_name, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (module_name, module))
    walker = _Walker(model)
    params: Dict[str, torch.nn.Parameter] = {}
    kept: List[str] = []
    scales: List[Tuple[str, torch.nn.Parameter, Any]] = []
    for param_name, param in model.named_parameters():
        params[param_name] = param
        module_path, module = owners[id(param)]
        leaf = param_name.rsplit(".", 1)[-1]
        if not param.data.is_contiguous():
            raise walker.refuse(param_name, module, param, "not contiguous")
        if fp8 and leaf in _KV_CACHE_SCALES and param.numel() <= 1:
            kept.append(param_name)  # KV-cache scales: no FP8 block checkpoint has them
            continue
        if fp8 and leaf.endswith("weight" + SCALE_SUFFIX):
            if param.dtype != torch.float32:
                raise walker.refuse(param_name, module, param,
                                    f"scale dtype {param.dtype} (float32 block scales only)")
            scales.append((param_name, param, module))
            continue
        allowed = (torch.bfloat16, torch.float16, torch.float32) + (_FP8 if fp8 else ())
        if param.dtype not in allowed:
            raise walker.refuse(param_name, module, param, f"dtype {param.dtype}")
        if param.dtype in _FP8 and not hasattr(module, leaf + SCALE_SUFFIX):
            raise walker.refuse(param_name, module, param,
                                f"FP8 without a block scale {leaf}{SCALE_SUFFIX}")
        change = _fp8_kernel_change(module) if param.dtype in _FP8 else None
        if change is not None:
            raise walker.refuse(
                param_name, module, param,
                f"{change}, so the checkpoint's format the refit writes is not what it computes "
                "with; use a kernel that keeps it (VLLM_USE_DEEP_GEMM=0 and the Triton or "
                "CUTLASS block kernels, the Triton MoE backend)",
            )
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
    for param_name, param, module in scales:
        weight_name = param_name[: -len(SCALE_SUFFIX)]
        weight = params.get(weight_name)
        if weight is None or weight.dtype not in _FP8:
            raise walker.refuse(param_name, module, param, f"scales {weight_name}, not an FP8 weight")
        walker.scales(param_name, param, module, weight_name, weight)

    ranges: Dict[str, List[Tuple[int, int, str]]] = {}
    for p in walker.pieces:
        ranges.setdefault(p.param, []).append((p.offset, p.numel, p.name))
    for param_name, offset, count in walker.zeros:
        ranges.setdefault(param_name, []).append((offset, count, "zeros"))
    for param_name, param in params.items():
        if param_name in kept:
            continue
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
    return ModelPieces(tuple(walker.pieces), tuple(walker.zeros), params, tuple(kept))
