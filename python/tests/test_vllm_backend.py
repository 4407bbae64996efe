"""The ``ncclreshard`` vLLM weight-transfer backend against real vLLM 0.33 models on CPU
processes (vllm_world.RefitWorld; run by scripts/vllm-tests.sh in target/vllm-venv).

Each case builds the model in vLLM worker processes, gives its checkpoint (vllm_harness) to
trainer processes as FSDP2, FSDP2 + TP or Megatron-style tensors, and refits twice, with
different weights, through vLLM's own weight-transfer API (load_general_plugins, the engine
factory, init/start/update/finish as vLLM's worker calls them). Before each update every byte
of every vLLM parameter is overwritten; after it, every parameter of every rank must equal
what vLLM's own ``load_weights`` of that step's checkpoint gives in a fresh model. The second
step reuses the first step's plan. Each case prints vLLM's own ``nccl_m2n`` "direct byte
coverage" for the same model beside ours (every byte direct).

Default: the cases CI runs (every parameter kind: GQA with KV heads replicated at TP 4, padded
vocabulary, tied embeddings, MoE with EP and with TP, shared experts, biases, FP8 block-quantized
dense and MoE models with their scales; FSDP2, FSDP2 + TP and Megatron sources, and vLLM's own
ModuleSource). ``NCCLRESHARD_VLLM_SWEEP=1``: every model at TP 1, 2, 4 (MoE also EP 2,
4) from every source. Bad input raises on every rank, trainers and workers, naming the tensor
and the vLLM parameter, before anything is sent.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterator, List, Tuple

import pytest

pytest.importorskip("vllm", reason="needs vLLM: scripts/vllm-tests.sh runs these in target/vllm-venv")

import vllm_harness as harness  # noqa: E402
from vllm_world import RefitWorld, RemoteFailure  # noqa: E402

SWEEP = os.environ.get("NCCLRESHARD_VLLM_SWEEP") == "1"

Case = Tuple[str, int, bool, str]
CI_CASES: List[Case] = [
    ("qwen3", 4, False, "fsdp2+tp"),      # KV heads replicated, vocabulary 1100 -> 4 x 288
    ("qwen3", 4, False, "megatron"),      # interleaved linear_qkv, gated fc1, vocabulary blocks
    ("qwen3-tied", 2, False, "fsdp2"),    # tied LM head, sent once
    ("qwen3-moe", 4, True, "fsdp2"),      # EP: whole experts per rank; layer 0 dense
    ("qwen2-moe", 2, False, "fsdp2+tp"),  # experts under TP, shared expert and its gate, biases
    ("qwen3-moe", 2, False, "vllm-source"),  # vLLM's own ModuleSource (WeightSource) over FSDP2
    # FP8 16 x 16 blocks (vllm_harness.FP8_BLOCK): bf16 from the trainers, FP8 values and
    # weight_scale_inv written into vLLM's parameters; blocks a trainer shard holds whole are
    # quantized by their sender, the others (FSDP2 cuts the 8-row router gate) by receivers.
    ("qwen3-fp8", 4, False, "fsdp2+tp"),   # fused qkv/gate_up in FP8, KV heads replicated
    ("qwen3-fp8", 2, False, "megatron"),   # interleaved linear_qkv: scales group by group
    ("qwen3-moe-fp8", 2, True, "fsdp2"),   # FP8 experts under EP, quantized replicated gate
]


def _sweep() -> List[Case]:
    cases = []
    for model, config in harness.MODELS.items():
        moe = "num_experts" in config
        for tp, ep in [(1, False), (2, False), (4, False)] + ([(2, True), (4, True)] if moe else []):
            if moe and tp == 4 and not ep and harness.fp8_block(model):
                continue  # 8 expert rows a rank cut 16-row blocks: vLLM refuses to build it
            for kind in ("fsdp2", "fsdp2+tp", "vllm-source") + (() if moe else ("megatron",)):
                cases.append((model, tp, ep, kind))
    return cases


CASES = _sweep() if SWEEP else CI_CASES


@pytest.fixture(scope="module")
def world() -> Iterator[RefitWorld]:
    with RefitWorld(trainers=4, workers=4) as w:
        print(f"\n{w.trainers} trainer and {w.workers} vLLM worker processes started in {w.start_s:.1f} s")
        yield w


def _checkpoint_bytes(model: str) -> int:
    return sum(math.prod(s) * 2 for s in harness.checkpoint_shapes(model).values())


@pytest.mark.parametrize("model, tp, ep, kind", CASES, ids=[f"{m}-{'ep' if e else 'tp'}{t}-{k}" for m, t, e, k in CASES])
def test_refit_equals_load_weights(world: RefitWorld, model: str, tp: int, ep: bool, kind: str) -> None:
    result = world.refit(model, tp, ep, kind, seeds=[1, 2])
    assert result.plans == [1, 1], result.plans  # planned once, reused by the second step
    per_rank = result.params // tp
    assert per_rank * tp == result.params and per_rank > 0
    direct, params, m2n_bytes, total = result.m2n
    assert total == _checkpoint_bytes(model)
    steps = ", ".join(f"{s['transfer_s'] * 1e3:.0f} ms" for s in result.steps)
    print(f"\n{result.label}: {result.params} parameters, {result.bytes} bytes on {tp} ranks equal "
          f"load_weights after each of 2 refits (transfer {steps}; case {result.seconds:.1f} s); "
          f"direct byte coverage: ncclreshard {total}/{total} (100 %), nccl_m2n "
          f"{m2n_bytes}/{total} ({100 * m2n_bytes / total:.1f} %, {direct}/{params} parameters)")


def _raised_everywhere(world: RefitWorld, failure: RemoteFailure, tp: int, message: str) -> None:
    """`message` in every trainer's error and in every worker's."""
    text = str(failure)
    trainers = len(re.findall(r"^trainer \d+ ", text, re.M))
    assert trainers == world.trainers, text
    assert len(re.findall(message, text)) >= world.trainers, text
    for rank, errors in enumerate(world.errors(tp)):
        assert any(re.search(message, e) for e in errors), (rank, errors)


@pytest.mark.parametrize("options, message", [
    (dict(edit="unknown"), r"model\.layers\.0\.self_attn\.nonsense\.weight: the trainer sends it but "
                           r"the vLLM model has no parameter for it"),
    (dict(drop=["model.layers.1.self_attn.v_proj.weight"]),
     r"model\.layers\.1\.self_attn\.v_proj\.weight: vLLM's parameter "
     r"model\.layers\.1\.self_attn\.qkv_proj\.weight needs this checkpoint tensor and no trainer sends it"),
    (dict(edit="shape"), r"model\.layers\.1\.mlp\.down_proj\.weight: the trainer declares shape \[64, 120\] "
                         r"but vLLM's model\.layers\.1\.mlp\.down_proj\.weight takes \[64, 128\]"),
    (dict(edit="dtype"), r"model\.norm\.weight: the trainer sends torch\.float32 but vLLM's "
                         r"model\.norm\.weight is torch\.bfloat16"),
    (dict(edit="cut"), r"model\.embed_tokens\.weight: the trainer declares it as \[11, 100, 64\], groups "
                       r"of 100 rows, but vLLM's model\.embed_tokens\.weight on rank \d holds rows"),
], ids=["unknown-name", "missing-tensor", "shape", "dtype", "layout"])
def test_bad_declarations_raise_on_every_rank(world: RefitWorld, options: dict, message: str) -> None:
    world.build("qwen3", 2)
    try:
        with pytest.raises(RemoteFailure) as failure:
            world.start("qwen3", "fsdp2", 2, 1, **options)
        _raised_everywhere(world, failure.value, 2, message)
    finally:
        world.stop_engines(2)


def test_an_fp8_model_refuses_a_trainer_tensor_it_cannot_quantize_on_every_rank(world: RefitWorld) -> None:
    world.build("qwen3-fp8", 2)
    try:
        with pytest.raises(RemoteFailure) as failure:
            world.start("qwen3-fp8", "fsdp2", 2, 1, edit="fp8")
        _raised_everywhere(world, failure.value, 2,
                           r"model\.layers\.0\.self_attn\.q_proj\.weight: the trainer sends "
                           r"torch\.float8_e4m3fn; vLLM's model\.layers\.0\.self_attn\.qkv_proj\.weight "
                           r"is torch\.float8_e4m3fn in blocks")
    finally:
        world.stop_engines(2)


@pytest.mark.parametrize("quantization, block, message", [
    ("fp8", None, r"the model is quantized \(fp8 per tensor\)"),
    ("awq", None, r"the model is quantized \(awq\)"),
])
def test_quantizations_other_than_fp8_blocks_are_refused(quantization, block, message) -> None:
    from types import SimpleNamespace

    import torch
    from ncclreshard.vllm.layouts import destination_pieces
    from ncclreshard.vllm.specs import RefitError

    config = SimpleNamespace(model_config=SimpleNamespace(quantization=quantization),
                             quant_config=SimpleNamespace(weight_block_size=block))
    with pytest.raises(RefitError, match=message):
        destination_pieces(torch.nn.Linear(2, 2), config)


def test_fp8_kernels_that_transform_loaded_weights_are_named() -> None:
    """An in-place refit writes the checkpoint's FP8 format: kernels whose post-load step
    changes it (DeepGEMM, Marlin, converting MoE backends) are refused by name."""
    from types import SimpleNamespace

    from ncclreshard.vllm.layouts import _fp8_kernel_change
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )

    class Keeps(Fp8BlockScaledMMLinearKernel):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):  # noqa: N803 - vLLM's names
            raise NotImplementedError

    class Repacks(Keeps):
        def process_weights_after_loading(self, layer):
            pass

    def layer(**method):
        return SimpleNamespace(quant_method=SimpleNamespace(**method))

    keeps, repacks = object.__new__(Keeps), object.__new__(Repacks)
    assert _fp8_kernel_change(layer(fp8_linear=keeps)) is None
    assert "Repacks transforms" in _fp8_kernel_change(layer(fp8_linear=repacks))
    assert "Marlin" in _fp8_kernel_change(layer(use_marlin=True, fp8_linear=keeps))
    assert _fp8_kernel_change(layer(fp8_backend=SimpleNamespace(value="TRITON"))) is None
    assert "DEEPGEMM converts" in _fp8_kernel_change(layer(fp8_backend=SimpleNamespace(value="DEEPGEMM")))


def test_bad_updates_raise_on_every_rank_before_anything_is_sent(world: RefitWorld) -> None:
    """After a good init: an update naming a tensor never declared, a trainer rank whose view
    no longer fits (refused at the update's agreement: nothing moves, every worker byte keeps
    what start wrote), and an update that leaves tensors out (refused at finish)."""
    world.build("qwen3", 2)
    try:
        world.start("qwen3", "megatron", 2, 1)
        with pytest.raises(RemoteFailure) as failure:
            world.send(2, names=["model.layers.0.self_attn.nonsense.weight"])
        _raised_everywhere(world, failure.value, 2,
                           r"'model\.layers\.0\.self_attn\.nonsense\.weight' is not among the tensors declared")
        assert world.untouched(2) == [True, True]

        with pytest.raises(RemoteFailure) as failure:
            world.send(2, names=["model.norm.weight"])
        _raised_everywhere(world, failure.value, 2,
                           r"sent 1 of \d+ declared tensors; 'model\.embed_tokens\.weight' "
                           r"\(vLLM's model\.embed_tokens\.weight\) and \d+ more were not updated")

        world.corrupt(1, "model.layers.0.self_attn.o_proj.weight")
        with pytest.raises(RemoteFailure) as failure:
            world.send(3)
        _raised_everywhere(world, failure.value, 2,
                           r"rank 1: ValueError: src\[\d+\] \('model\.layers\.0\.self_attn\.o_proj\.weight'\): "
                           r"shape is \[64, 63\]|rank 1: ValueError: src\[\d+\] \('model\.layers\.0\.self_attn\.o_proj\.weight'\): shape")
        assert world.untouched(2) == [True, True]
    finally:
        world.stop_engines(2)


def test_a_new_trainer_layout_is_declared_and_planned_once_more(world: RefitWorld) -> None:
    """The trainer changes its sharding between steps (every DTensor redistributed to
    Replicate): the next send declares a new epoch, every rank plans once more, and the refit
    is again exact; the step after reuses that plan."""
    world.build("qwen3-moe", 2, True)
    try:
        world.start("qwen3-moe", "fsdp2", 2, 1)
        assert [s["plans"] for s in world.send(1)] == [1] * world.trainers
        world.verify(2, 1)
        world.relayout()
        for seed in (2, 3):
            sent = world.send(seed)
            assert [(s["plans"], s["epoch"]) for s in sent] == [(2, 1)] * world.trainers, sent
            assert [v["plans"] for v in world.verify(2, seed)] == [2, 2]
    finally:
        world.stop_engines(2)
