"""Real vLLM 0.33 models on CPU processes: the oracle for a vLLM weight-transfer backend.

Not a test by itself. It needs the environment of scripts/vllm-venv.sh (vLLM is installed there
with --no-deps next to a CPU-usable torch); the package's own venv does not have vLLM.

`run(model, tp, ...)` starts `tp` processes. Each one initialises vLLM's distributed state over
gloo (`init_distributed_environment`, `initialize_model_parallel`) and builds the real vLLM model
(`initialize_model`) from a tiny config.json written to a temporary directory, so the layers,
parameter classes and weight loaders are vLLM's own. Then it runs a job with the live model; the
default job feeds a full random checkpoint (Hugging Face names, deterministic per name and seed)
through `model.load_weights` and returns every parameter of that rank with what a destination
layout must know about it (class, loader, `output_dim`/`input_dim`/`packed_dim`, owning module,
tp/ep rank and size, the module's head/vocab/expert geometry).

`expected_pieces` states, independently of vLLM's code, which slice of which checkpoint tensor
lands where in a rank's parameter (docs/vllm-notes.md explains each case); `check` compares it
byte for byte with what `load_weights` wrote. `m2n_coverage` runs vLLM's own `nccl_m2n`
destination resolution (`m2n_layout.resolve_parameter_destinations`) on the live model, and
`post_load_changes` vLLM's `process_weights_after_loading`.

FP8 block-quantized models (`qwen3-fp8`, `qwen3-moe-fp8`) build with a stand-in block kernel
(`_register_fp8_stand_in`); their checkpoint holds FP8 weights and `weight_scale_inv` made by
an independent reference quantizer (`quantize_blocks`) from the bf16 one the trainers hold
(`trainer_checkpoint`), and `check` states the scales' layout as the weight's over the block
grid (`expected_scale_pieces`).

CLI (target/vllm-venv/bin/python): python/tests/vllm_harness.py --model qwen3 --tp 2 [--ep]
[--rank all] [--check] [--m2n] | [--post-load]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

# vLLM picks its platform when first imported; every process of the harness is a CPU one.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# Tiny Hugging Face configs. Sizes are chosen so that the interesting cases show at TP 1, 2 and 4:
# two KV heads (replicated at TP 4); a vocabulary of 1100, which vLLM pads to 1152 (a multiple of
# 64, not of 64 x TP: 288 rows a rank at TP 4, the last one with 52 rows of padding); eight
# experts (4 or 2 a rank under EP).
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

MODELS: Dict[str, Dict[str, Any]] = {
    # Dense, GQA with 2 KV heads, untied LM head.
    "qwen3": dict(_QWEN3),
    # The same with the LM head tied to the embedding (no lm_head.weight in the checkpoint).
    "qwen3-tied": dict(_QWEN3, tie_word_embeddings=True),
    # MoE without shared experts; layer 0 keeps a dense MLP so both kinds are present.
    "qwen3-moe": dict(
        _QWEN3,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
    # MoE with a shared expert (and its sigmoid gate) and q/k/v biases.
    "qwen2-moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1100,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
    },
}

# FP8 block quantization as DeepSeek-V3's checkpoints carry it (vLLM's "fp8" method with
# `weight_block_size`): every linear layer's weight in float8_e4m3fn with one float32
# dequantization multiplier per block (`weight_scale_inv`); embeddings, LM head, norms and the
# router gate stay bf16. Blocks of 16 x 16 make several blocks per shard of these tiny layers
# (DeepSeek's are 128 x 128), and vLLM's own CPU kernels (AMX, 128-column blocks only) never
# take them: the stand-in kernel below does.
FP8_BLOCK = [16, 16]
_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK}
MODELS["qwen3-fp8"] = dict(_QWEN3, quantization_config=_FP8)
MODELS["qwen3-moe-fp8"] = dict(MODELS["qwen3-moe"], quantization_config=_FP8)


def fp8_block(model: str) -> Optional[Tuple[int, int]]:
    """The FP8 block (rows, cols) of `model`'s checkpoint, None when it is not quantized."""
    q = MODELS[model].get("quantization_config")
    return tuple(q["weight_block_size"]) if q else None  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# The checkpoint: Hugging Face names and shapes, values from a per-name seed
# ---------------------------------------------------------------------------------------------


def checkpoint_shapes(model: str) -> Dict[str, Tuple[int, ...]]:
    """Every tensor of a Hugging Face checkpoint of `model`, in the order a safetensors index lists
    them, with its full shape."""
    c = MODELS[model]
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", hidden // heads)
    qwen3 = c["model_type"].startswith("qwen3")
    bias = c.get("attention_bias", False) or c["model_type"] == "qwen2_moe"
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        if bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (heads * head_dim,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_heads * head_dim,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_heads * head_dim,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if qwen3:
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        if _is_moe_layer(c, layer):
            experts, inter = c["num_experts"], c["moe_intermediate_size"]
            shapes[f"{p}.mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
            shared = c.get("shared_expert_intermediate_size", 0)
            if shared:
                shapes[f"{p}.mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
                shapes[f"{p}.mlp.shared_expert.up_proj.weight"] = (shared, hidden)
                shapes[f"{p}.mlp.shared_expert.down_proj.weight"] = (hidden, shared)
                shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, hidden)
        else:
            inter = c["intermediate_size"]
            shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
            shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
            shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _is_moe_layer(config: Dict[str, Any], layer: int) -> bool:
    if "num_experts" not in config or layer in config.get("mlp_only_layers", []):
        return False
    return (layer + 1) % config.get("decoder_sparse_step", 1) == 0


def checkpoint_tensor(name: str, shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """One bf16 checkpoint tensor; the same (name, seed) gives the same bytes in any process, so
    each rank makes the checkpoint itself and no tensor crosses a process boundary."""
    gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 16) ^ seed)
    return (torch.randn(tuple(shape), generator=gen) * 0.05).to(torch.bfloat16)


def trainer_checkpoint(model: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The checkpoint as a trainer holds it: every tensor bf16."""
    return {n: checkpoint_tensor(n, s, seed) for n, s in checkpoint_shapes(model).items()}


def is_quantized(model: str, name: str) -> bool:
    """Whether vLLM keeps checkpoint tensor `name` of `model` in FP8: the weight of every
    linear layer built with the quantization config: attention, MLP, experts and shared
    expert (all named ``*_proj.weight`` here) and Qwen3-MoE's router gate (a replicated linear
    layer, fewer rows than a block), nothing else."""
    return fp8_block(model) is not None and name.endswith(("_proj.weight", ".mlp.gate.weight"))


def unloaded_by_design(model: str, names: Sequence[str]) -> List[str]:
    """The parameters of `model` its checkpoint does not carry, which `load_weights` leaves as
    the model was built: an FP8 model's attention layers get KV-cache scales
    (``attn.k_scale``, ``v_scale``, ``q_scale``, ``prob_scale``), which only a checkpoint with
    a quantized KV cache has."""
    if fp8_block(model) is None:
        return []
    suffixes = tuple(f".attn.{s}_scale" for s in ("k", "v", "q", "prob"))
    return [n for n in names if n.endswith(suffixes)]


def quantize_blocks(w: torch.Tensor, block: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor in float8_e4m3fn blocks and their float32 dequantization multipliers, as
    DeepSeek-V3's `weight_quant` makes its checkpoints, over the whole tensor: per block
    ``s = max(amax, 1e-4) / 448`` (the 1e-4 floor of DeepGEMM's `per_block_cast_to_fp8`),
    values ``x / s`` rounded to nearest-even and clamped to +-448; `s` stored. Written
    independently of the library's quantizers (docs/quantization.md §3 states the same)."""
    rows, cols = w.shape
    bn, bk = block
    x = w.float()
    values = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty((-(-rows // bn), -(-cols // bk)), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = part.abs().max().clamp(min=1e-4) / 448.0
            values[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part / s).clamp(-448.0, 448.0).to(
                torch.float8_e4m3fn
            )
            scales[i, j] = s
    return values, scales


def checkpoint(model: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The checkpoint vLLM's loader reads: the trainer's bf16 tensors, and for an FP8 model each
    quantized weight in FP8 blocks followed by its ``weight_scale_inv``."""
    out: Dict[str, torch.Tensor] = {}
    block = fp8_block(model)
    for name, w in trainer_checkpoint(model, seed).items():
        if is_quantized(model, name):
            out[name], out[f"{name}_scale_inv"] = quantize_blocks(w, block)
        else:
            out[name] = w
    return out


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What a job gets in each process: the live vLLM model and this rank's place."""

    model_name: str
    model: Any  # torch.nn.Module, vLLM's
    vllm_config: Any
    rank: int
    tp_size: int
    ep: bool
    seed: int
    workdir: Path
    seconds_build: float


@dataclasses.dataclass
class ParamRecord:
    """One parameter of one vLLM rank after `load_weights`."""

    name: str
    tensor: torch.Tensor
    cls: str
    loader: Optional[str]
    output_dim: Optional[int]
    input_dim: Optional[int]
    packed_dim: Optional[int]
    module: str
    module_name: str
    # The owning module's geometry, for the layouts: heads for QKV, vocab shard for embeddings,
    # output_sizes for merged columns, expert map and tp for MoE.
    geometry: Dict[str, Any]


@dataclasses.dataclass
class RankResult:
    rank: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    seconds_build: float
    seconds_load: float
    params: Dict[str, ParamRecord]
    loaded_names: List[str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_fp8_stand_in_registered = False


def _register_fp8_stand_in() -> None:
    """Registers with vLLM (its own `register_linear_kernel`, for the CPU platform) a block-FP8
    linear kernel in plain torch ops: the weight dequantized block by block, then a matmul. A
    test double for hardware this machine lacks: vLLM's CPU FP8 kernels need AMX and 128-column
    blocks, so without it vLLM refuses to build an FP8 model here. Its post-load processing is
    vLLM's base class's (what its CUDA Triton and CUTLASS block kernels do: the loaded bytes
    stay as loaded), so parameters keep the loader's layout, as on those GPUs."""
    global _fp8_stand_in_registered
    if _fp8_stand_in_registered:
        return  # once per process
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.platforms import PlatformEnum, current_platform

    class TorchFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False  # bf16 activations times dequantized weights

        @classmethod
        def is_supported(cls, compute_capability: Optional[int] = None) -> Tuple[bool, Optional[str]]:
            if not current_platform.is_cpu():
                return False, "the test harness's CPU stand-in"
            return True, None

        def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor,
                                  Bs: torch.Tensor) -> torch.Tensor:
            bn, bk = self.weight_group_shape.row, self.weight_group_shape.col
            n, k = B.shape
            scale = Bs.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            return A.float() @ (B.float() * scale).t()

    register_linear_kernel(TorchFp8BlockKernel, PlatformEnum.CPU, "fp8_block")
    _fp8_stand_in_registered = True


def configure(model_name: str, tp: int, ep: bool, workdir: Path, rank: int = 0) -> Any:
    """A new VllmConfig of `model_name` at TP `tp` (`ep`: expert parallel) for TP rank `rank`,
    its config.json written under `workdir` (a directory of its own per call). Each model
    instance needs its own config: vLLM registers every attention layer in it by name."""
    import json

    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    if fp8_block(model_name) is not None:
        _register_fp8_stand_in()
    model_dir = workdir / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(MODELS[model_name]))
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16"
    )
    parallel = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep)
    # What vLLM's Worker sets before loading the model: the rank within the TP x PP world.
    parallel.rank = rank
    return VllmConfig(
        model_config=model_config,
        parallel_config=parallel,
        load_config=LoadConfig(load_format="dummy"),
    )


def build(model_name: str, tp: int, ep: bool, rank: int, port: int, workdir: Path):
    """Rank `rank` of vLLM's distributed state over gloo (`tp` ranks, rendezvous at `port`) and
    its instance of `model_name` (dummy weights), configured in `workdir`. Undo with
    `teardown()` before building another in the same process."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vllm_config = configure(model_name, tp, ep, workdir, rank)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=tp)
        model = new_model(vllm_config)
    return model, vllm_config


def new_model(vllm_config: Any) -> Any:
    """An instance of the model of `vllm_config` (a config of its own, from `configure`) in this
    process, whose distributed state is initialised: e.g. a fresh model for the oracle's
    `load_weights`."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config):
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            return initialize_model(vllm_config=vllm_config)


def teardown() -> None:
    # vLLM's groups hold shared-memory broadcast queues; released here, not by the tracker.
    # Nothing to release when vLLM never got imported (a rank that failed before that).
    if "vllm.distributed" not in sys.modules:
        return
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def _worker(
    model_name: str,
    tp: int,
    ep: bool,
    rank: int,
    port: int,
    seed: int,
    workdir: str,
    job: Callable[[Context], Any],
) -> None:
    out = Path(workdir) / f"rank{rank}.pt"
    try:
        # The ranks share the machine's cores: one intra-op thread each keeps them from
        # oversubscribing it.
        torch.set_num_threads(1)
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        model, vllm_config = build(model_name, tp, ep, rank, port, Path(workdir) / f"r{rank}")
        ctx = Context(
            model_name, model, vllm_config, rank, tp, ep, seed, Path(workdir),
            time.perf_counter() - t0,
        )
        with set_current_vllm_config(vllm_config):
            result = job(ctx)
        torch.save({"ok": result}, out)
    except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
        torch.save({"error": traceback.format_exc()}, out)
    finally:
        teardown()


def _load(path: Path) -> Dict[str, Any]:
    # A rank writes its file once, after its job; a missing file is a rank still working or one
    # that died without a word.
    return torch.load(path, weights_only=False) if path.exists() else {}


def run(
    model: str,
    tp: int,
    *,
    ep: bool = False,
    seed: int = 0,
    job: Optional[Callable[[Context], Any]] = None,
    timeout: float = 600.0,
) -> List[Any]:
    """Build `model` in `tp` CPU processes and run `job(ctx)` in each; returns the jobs' results
    in rank order (by default `collect_parameters`: a RankResult per rank).

    `job` must be a module-level function (it is pickled into spawned processes) and its result
    must be picklable by torch.save. A failing rank raises here with its traceback, and the ranks
    it leaves waiting are stopped 10 s later; ranks still running after `timeout` seconds are
    killed and reported, never waited on forever."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {sorted(MODELS)}")
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    job = job or collect_parameters
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="vllm-harness-") as workdir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(model, tp, ep, rank, port, seed, workdir, job),
                name=f"vllm-rank{rank}",
            )
            for rank in range(tp)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: Optional[float] = None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            # A rank that failed leaves the others waiting in a collective: give them a few
            # seconds to fail on their own, then stop them instead of waiting for the timeout.
            if failed_at is None and any(
                not p.is_alive()
                and (p.exitcode != 0 or "error" in _load(Path(workdir) / f"rank{rank}.pt"))
                for rank, p in enumerate(procs)
            ):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 10:
                break
            time.sleep(0.2)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        results, errors = [], []
        for rank, p in enumerate(procs):
            payload = _load(Path(workdir) / f"rank{rank}.pt")
            if "error" in payload:
                errors.append(f"rank {rank}:\n{payload['error']}")
            elif p in hung:
                errors.append(f"rank {rank}: still running, killed")
            elif "ok" not in payload or p.exitcode != 0:
                errors.append(f"rank {rank}: exit code {p.exitcode} and no result")
            else:
                results.append(payload["ok"])
        if errors:
            raise RuntimeError(f"{model} at TP {tp}{' EP' if ep else ''}:\n" + "\n".join(errors))
        return results


# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------


def _qualname(fn: Any) -> Optional[str]:
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__qualname__", type(fn).__name__)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _geometry(module: Any) -> Dict[str, Any]:
    g: Dict[str, Any] = {}
    for attr in (
        "tp_rank",
        "tp_size",
        "output_sizes",
        "num_heads",
        "num_kv_heads",
        "num_kv_head_replicas",
        "total_num_heads",
        "total_num_kv_heads",
        "head_size",
        "v_head_size",
        "org_vocab_size",
        "num_embeddings_padded",
        "num_embeddings_per_partition",
        "global_num_experts",
        "local_num_experts",
    ):
        value = getattr(module, attr, None)
        if isinstance(value, (int, list, tuple)) and not isinstance(value, bool):
            g[attr] = list(value) if isinstance(value, (list, tuple)) else value
    indices = getattr(module, "shard_indices", None)
    if indices is not None:
        g["org_vocab_start_index"] = indices.org_vocab_start_index
        g["org_vocab_end_index"] = indices.org_vocab_end_index
    moe_config = getattr(module, "moe_config", None)
    if moe_config is not None:
        par = moe_config.moe_parallel_config
        g["moe_tp_rank"], g["moe_tp_size"] = par.tp_rank, par.tp_size
        g["moe_ep_rank"], g["moe_ep_size"] = par.ep_rank, par.ep_size
        g["is_act_and_mul"] = bool(moe_config.is_act_and_mul)
        manager = getattr(module, "expert_map_manager", None)
        if manager is not None:
            g["local_to_global_experts"] = [
                e
                for _, e in sorted(
                    (manager.map_global_to_local(e), e)
                    for e in range(module.global_num_experts)
                    if manager.map_global_to_local(e) >= 0
                )
            ]
    return g


def collect_parameters(ctx: Context) -> RankResult:
    """The default job: load a full checkpoint with vLLM's own `load_weights` and return every
    parameter of this rank. Fails when the loader leaves a parameter unloaded or does not
    consume the whole checkpoint: the oracle must cover the model."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    model = ctx.model
    t0 = time.perf_counter()
    ckpt = checkpoint(ctx.model_name, ctx.seed)
    loaded = set(model.load_weights(iter(ckpt.items())))
    seconds_load = time.perf_counter() - t0
    params = dict(model.named_parameters())
    missing = sorted(set(params) - loaded - set(unloaded_by_design(ctx.model_name, params)))
    if missing:
        raise RuntimeError(f"load_weights left parameters unloaded: {missing}")

    owners = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (module_name, module, pname))

    ep_rank, ep_size = 0, 1
    records: Dict[str, ParamRecord] = {}
    for name, p in params.items():
        module_name, module, _ = owners[id(p)]
        loader = getattr(p, "_weight_loader", None) or getattr(p, "weight_loader", None)
        geometry = _geometry(module)
        if "moe_ep_size" in geometry:
            ep_rank, ep_size = geometry["moe_ep_rank"], geometry["moe_ep_size"]
        records[name] = ParamRecord(
            name=name,
            tensor=p.data.detach().clone(),
            cls=_type_name(p),
            loader=_qualname(loader),
            output_dim=getattr(p, "output_dim", None),
            input_dim=getattr(p, "input_dim", None),
            packed_dim=getattr(p, "packed_dim", None),
            module=_type_name(module),
            module_name=module_name,
            geometry=geometry,
        )
    return RankResult(
        rank=ctx.rank,
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=get_tensor_model_parallel_world_size(),
        ep_rank=ep_rank,
        ep_size=ep_size,
        seconds_build=ctx.seconds_build,
        seconds_load=seconds_load,
        params=records,
        loaded_names=sorted(loaded),
    )


@dataclasses.dataclass
class M2NCoverage:
    """vLLM's own nccl_m2n destination plan for this rank."""

    direct: List[str]
    fallback: List[str]
    direct_bytes: int
    total_bytes: int
    log: List[str]


def m2n_coverage(ctx: Context) -> M2NCoverage:
    """Run vLLM's `resolve_parameter_destinations` on the live model for the checkpoint's names,
    as `M2NWeightTransferEngine._prepare_destination_plan` does, with the destination mesh
    `(1, tp)` (a trainer must declare `dst_mesh_dims=(1, tp)`; the default `(tp, 1)` makes the
    shard axis 1 and no TP-sharded parameter can resolve). Captures vLLM's log line."""
    from vllm.distributed.weight_transfer import m2n_layout

    shapes = checkpoint_shapes(ctx.model_name)
    lines: List[str] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = _Capture(level=logging.INFO)
    m2n_layout.logger.addHandler(handler)
    old_level = m2n_layout.logger.level
    m2n_layout.logger.setLevel(logging.INFO)
    try:
        quantization = getattr(ctx.vllm_config.model_config, "quantization", None)
        pp = ctx.vllm_config.parallel_config.pipeline_parallel_size
        destinations = m2n_layout.resolve_parameter_destinations(
            ctx.model,
            list(shapes),
            [torch.bfloat16] * len(shapes),
            list(shapes.values()),
            num_workers=ctx.tp_size,
            shard_axis_size=ctx.tp_size,
            allow_direct=quantization is None and pp == 1,
        )
    finally:
        m2n_layout.logger.removeHandler(handler)
        m2n_layout.logger.setLevel(old_level)
    nbytes = {n: math.prod(s) * 2 for n, s in shapes.items()}
    direct = [d.name for d in destinations if d.direct]
    return M2NCoverage(
        direct=direct,
        fallback=[d.name for d in destinations if not d.direct],
        direct_bytes=sum(nbytes[n] for n in direct),
        total_bytes=sum(nbytes.values()),
        log=lines,
    )


def post_load_changes(ctx: Context) -> Dict[str, str]:
    """Load the checkpoint, then run vLLM's `process_weights_after_loading` as its model loader
    does after `load_weights`, and say what it did to each parameter: a backend that writes
    into live parameters writes into the processed ones. Returns {name: change}; parameters left
    byte-identical are omitted."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = ctx.model
    model.load_weights(iter(checkpoint(ctx.model_name, ctx.seed).items()))
    before = {n: (p, p.data.clone()) for n, p in model.named_parameters()}
    process_weights_after_loading(model, ctx.vllm_config.model_config, torch.device("cpu"))
    after = dict(model.named_parameters())
    changes: Dict[str, str] = {}
    for name, (param, data) in before.items():
        now = after.get(name)
        if now is None:
            changes[name] = "removed"
        elif now is not param:
            changes[name] = f"replaced: {tuple(data.shape)} -> {tuple(now.shape)} {now.dtype}"
        elif tuple(now.shape) != tuple(data.shape) or now.dtype != data.dtype:
            changes[name] = f"reshaped: {tuple(data.shape)} -> {tuple(now.shape)} {now.dtype}"
        elif not torch.equal(now.data, data):
            changes[name] = "values changed"
    for name in sorted(set(after) - set(before)):
        changes[name] = f"added: {tuple(after[name].shape)} {after[name].dtype}"
    return changes


def parameters_and_m2n(ctx: Context) -> Tuple[RankResult, M2NCoverage]:
    """Both jobs in one start of the processes (importing vLLM is most of a run's time)."""
    return collect_parameters(ctx), m2n_coverage(ctx)


# ---------------------------------------------------------------------------------------------
# The layouts, stated independently of vLLM's loaders
# ---------------------------------------------------------------------------------------------

# A piece: rows/cols `src` of checkpoint tensor `hf_name` land at `dst` of the rank's parameter.
# Index tuples are tuples of slices (or an int for an expert's leading index). A piece with
# hf_name None is padding the loader fills with zeros.
Piece = Tuple[Optional[str], Tuple[Any, ...], Tuple[Any, ...]]


def _rows(start: int, size: int) -> slice:
    return slice(start, start + size)


def expected_pieces(model: str, record: ParamRecord) -> List[Piece]:
    """Where every element of one rank's vLLM parameter comes from in the HF checkpoint."""
    c = MODELS[model]
    name, g = record.name, record.geometry
    kind = record.module.rsplit(".", 1)[-1]
    local = tuple(record.tensor.shape)
    everything = tuple(slice(None) for _ in local)
    prefix = name.rsplit(".", 1)[0]  # module path
    leaf = name.rsplit(".", 1)[1]  # weight / bias / w13_weight / ...

    if kind in ("VocabParallelEmbedding", "ParallelLMHead"):
        hf = "model.embed_tokens.weight" if c["tie_word_embeddings"] else name
        start, end = g["org_vocab_start_index"], g["org_vocab_end_index"]
        pieces: List[Piece] = [(hf, (_rows(start, end - start),), (_rows(0, end - start),))]
        if end - start < local[0]:
            pieces.append((None, (), (slice(end - start, local[0]),)))
        return pieces

    if kind == "QKVParallelLinear":
        tp_rank, replicas = g["tp_rank"], g["num_kv_head_replicas"]
        q = g["num_heads"] * g["head_size"]
        kv = g["num_kv_heads"] * g["head_size"]
        v = g["num_kv_heads"] * g["v_head_size"]
        base = prefix.rsplit(".", 1)[0]
        kv_rank = tp_rank // replicas  # the KV head group this rank shares with replicas - 1 others
        return [
            (f"{base}.q_proj.{leaf}", (_rows(tp_rank * q, q),), (_rows(0, q),)),
            (f"{base}.k_proj.{leaf}", (_rows(kv_rank * kv, kv),), (_rows(q, kv),)),
            (f"{base}.v_proj.{leaf}", (_rows(kv_rank * v, v),), (_rows(q + kv, v),)),
        ]

    if kind == "MergedColumnParallelLinear":
        tp_rank, tp_size = g["tp_rank"], g["tp_size"]
        base = prefix.rsplit(".", 1)[0]
        names = ["gate_proj", "up_proj"]
        pieces, offset = [], 0
        for part, size in zip(names, g["output_sizes"]):
            n = size // tp_size
            pieces.append((f"{base}.{part}.{leaf}", (_rows(tp_rank * n, n),), (_rows(offset, n),)))
            offset += n
        return pieces

    if kind == "ColumnParallelLinear":
        n = local[0]
        return [(name, (_rows(g["tp_rank"] * n, n),), (_rows(0, n),))]

    if kind == "RowParallelLinear":
        if leaf == "bias":  # not sharded: every rank adds it once after the reduction
            return [(name, everything, everything)]
        n = local[1]
        return [(name, (slice(None), _rows(g["tp_rank"] * n, n)), everything)]

    if kind in ("FusedMoE", "SharedFusedMoE", "RoutedExperts"):
        # vLLM keeps the experts under `<mlp>.experts.routed_experts`; the checkpoint under
        # `<mlp>.experts.<global expert id>`.
        layer_prefix = name.split(".experts.")[0]
        tp_rank, tp_size = g["moe_tp_rank"], g["moe_tp_size"]
        pieces = []
        for local_e, global_e in enumerate(g["local_to_global_experts"]):
            ex = f"{layer_prefix}.experts.{global_e}"
            if leaf == "w13_weight":
                n = local[1] // 2
                for half, part in enumerate(("gate_proj", "up_proj")):
                    full = f"{ex}.{part}.weight"
                    pieces.append(
                        (full, (_rows(tp_rank * n, n),), (local_e, _rows(half * n, n)))
                    )
            elif leaf == "w2_weight":
                n = local[2]
                pieces.append(
                    (
                        f"{ex}.down_proj.weight",
                        (slice(None), _rows(tp_rank * n, n)),
                        (local_e, slice(None), slice(None)),
                    )
                )
            else:
                raise ValueError(f"{name}: no layout stated for MoE parameter {leaf}")
        assert tp_size * (local[1] // 2 if leaf == "w13_weight" else local[2]) > 0
        return pieces

    # Replicated: norms, the router gate, the shared expert gate.
    return [(name, everything, everything)]


def _in_blocks(index: Tuple[Any, ...], ndim: int, block: Sequence[int]) -> Tuple[Any, ...]:
    """An index of a tensor of `ndim` dims (ints and slices, leading dims first) as the index of
    its block grid: rows (dim -2) in blocks of block[0], columns (dim -1) of block[1]."""
    out = []
    for d, ix in enumerate(index):
        size = block[0] if d == ndim - 2 else block[1] if d == ndim - 1 else 1
        if isinstance(ix, slice) and size > 1 and ix != slice(None):
            assert ix.start % size == 0, (index, block)
            out.append(slice(ix.start // size, -(-ix.stop // size)))
        else:
            out.append(ix)
    return tuple(out)


def expected_scale_pieces(model: str, weight: ParamRecord, scale: ParamRecord) -> List[Piece]:
    """Where every block scale of an FP8 weight's `weight_scale_inv` comes from: the weight's
    pieces with rows and columns counted in blocks (the checkpoint's scale tensor is the block
    grid of its weight)."""
    block = fp8_block(model)
    assert block is not None
    nd = scale.tensor.dim()
    return [
        (f"{hf}_scale_inv", _in_blocks(src, 2, block), _in_blocks(dst, nd, block))
        for hf, src, dst in expected_pieces(model, weight)
    ]


def check(model: str, results: Sequence[RankResult], seed: int = 0) -> Tuple[int, int]:
    """Compare every element of every rank's parameters with `expected_pieces`: each element
    must be written by exactly one piece, with the checkpoint's bytes (or zero for padding).
    Returns (parameters, bytes) checked; raises naming the first parameter that differs."""
    ckpt = checkpoint(model, seed)
    n_params = n_bytes = 0
    for r in results:
        kept = set(unloaded_by_design(model, list(r.params)))
        for name, rec in r.params.items():
            if name in kept:
                continue
            expect = torch.empty_like(rec.tensor)
            covered = torch.zeros(rec.tensor.shape, dtype=torch.int32)
            if name.endswith("_scale_inv"):
                pieces = expected_scale_pieces(model, r.params[name[: -len("_scale_inv")]], rec)
            else:
                pieces = expected_pieces(model, rec)
            for hf, src, dst in pieces:
                if hf is None:
                    expect[dst] = 0
                else:
                    if hf not in ckpt:
                        raise AssertionError(f"rank {r.rank} {name}: no checkpoint tensor {hf}")
                    expect[dst] = ckpt[hf][src]
                covered[dst] += 1
            if not bool((covered == 1).all()):
                raise AssertionError(
                    f"rank {r.rank} {name}: pieces cover {int((covered == 0).sum())} elements "
                    f"0 times and {int((covered > 1).sum())} more than once"
                )
            same, got = expect.view(torch.uint8), rec.tensor.view(torch.uint8)
            if not torch.equal(same, got):
                bad = (same != got).nonzero()[0].tolist()
                raise AssertionError(
                    f"rank {r.rank} {name}: stated layout differs from load_weights at {bad}"
                )
            n_params += 1
            n_bytes += rec.tensor.numel() * rec.tensor.element_size()
    return n_params, n_bytes


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _table(result: RankResult) -> str:
    rows = [("name", "local shape", "dtype", "class", "loader", "module")]
    for name, rec in result.params.items():
        rows.append(
            (
                name,
                "x".join(map(str, rec.tensor.shape)),
                str(rec.tensor.dtype).replace("torch.", ""),
                rec.cls.rsplit(".", 1)[-1],
                rec.loader or "-",
                rec.module.rsplit(".", 1)[-1],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(col.ljust(w) for col, w in zip(row, widths)) for row in rows)


def _sweep(seed: int, timeout: float) -> int:
    failed = 0
    for model in MODELS:
        for tp, ep in ((1, False), (2, False), (4, False), (2, True), (4, True)):
            if ep and "num_experts" not in MODELS[model]:
                continue
            if fp8_block(model) and "num_experts" in MODELS[model] and tp == 4 and not ep:
                continue  # 8 expert rows a rank cut 16-row blocks: vLLM refuses to build it
            label = f"{model} TP {tp}{' EP' if ep else ''}"
            t0 = time.perf_counter()
            try:
                both = run(model, tp, ep=ep, seed=seed, timeout=timeout, job=parameters_and_m2n)
                n, nbytes = check(model, [b[0] for b in both], seed)
                cov = both[0][1]
                if any(b[1].direct != cov.direct for b in both):
                    raise AssertionError("ranks resolved different nccl_m2n destinations")
            except Exception as e:  # noqa: BLE001 - a sweep reports every failure and goes on
                failed += 1
                print(f"{label}: FAILED {e}", flush=True)
                continue
            print(
                f"{label}: {n} parameters, {nbytes} bytes equal the stated layouts; nccl_m2n "
                f"direct {len(cov.direct)}/{len(cov.direct) + len(cov.fallback)} parameters, "
                f"{cov.direct_bytes}/{cov.total_bytes} bytes "
                f"({100 * cov.direct_bytes / cov.total_bytes:.1f} %); "
                f"build {max(b[0].seconds_build for b in both):.1f} s, load_weights "
                f"{max(b[0].seconds_load for b in both):.2f} s, {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", action="store_true", help="vLLM's enable_expert_parallel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", default="0", help="which rank's table to print, or 'all'")
    ap.add_argument("--check", action="store_true", help="compare with the stated layouts")
    ap.add_argument("--m2n", action="store_true", help="vLLM's nccl_m2n direct byte coverage")
    ap.add_argument(
        "--post-load", action="store_true",
        help="only run vLLM's process_weights_after_loading and list what it changed",
    )
    ap.add_argument(
        "--sweep", action="store_true",
        help="every model at TP 1, 2, 4 (MoE also with EP 2, 4): --check and --m2n, one line each",
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error(f"--tp must be at least 1, got {args.tp}")
    if args.rank != "all" and not (args.rank.isdigit() and int(args.rank) < args.tp):
        ap.error(f"--rank must be 'all' or a rank below --tp {args.tp}, got {args.rank!r}")

    if args.sweep:
        return _sweep(args.seed, args.timeout)
    if args.post_load:
        changes = run(
            args.model, args.tp, ep=args.ep, seed=args.seed, timeout=args.timeout,
            job=post_load_changes,
        )
        for rank, ch in enumerate(changes):
            print(f"== rank {rank}: process_weights_after_loading changed {len(ch)} parameters")
            for name, what in ch.items():
                print(f"{name}: {what}")
        return 0

    t0 = time.perf_counter()
    both = run(
        args.model, args.tp, ep=args.ep, seed=args.seed, timeout=args.timeout,
        job=parameters_and_m2n if args.m2n else collect_parameters,
    )
    wall = time.perf_counter() - t0
    results: List[RankResult] = [b[0] for b in both] if args.m2n else both
    shown = results if args.rank == "all" else [results[int(args.rank)]]
    for r in shown:
        print(
            f"== {args.model} rank {r.rank}: tp {r.tp_rank}/{r.tp_size}, ep {r.ep_rank}/"
            f"{r.ep_size}; build {r.seconds_build:.1f} s, load_weights {r.seconds_load:.2f} s"
        )
        print(_table(r))
    print(f"{args.tp} process(es) in {wall:.1f} s wall")
    if args.check:
        n, nbytes = check(args.model, results, args.seed)
        print(f"check: {n} parameters, {nbytes} bytes on {args.tp} ranks equal the stated layouts")
    if args.m2n:
        c = both[0][1]
        for line in c.log:
            print(f"vLLM: {line}")
        print(
            f"nccl_m2n direct: {len(c.direct)}/{len(c.direct) + len(c.fallback)} parameters, "
            f"{c.direct_bytes}/{c.total_bytes} bytes "
            f"({100 * c.direct_bytes / c.total_bytes:.1f} %); direct: "
            + (", ".join(sorted({n.split('.', 3)[-1] if n.startswith('model.layers') else n
                                 for n in c.direct})) or "none")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
