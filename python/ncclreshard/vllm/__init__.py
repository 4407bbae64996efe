"""The ``ncclreshard`` weight-transfer backend for vLLM (0.33's ``vllm.distributed.weight_transfer``
API): a trainer sends its shards (FSDP2 / FSDP2 + TP DTensors, Megatron-style layouts) straight
into the live vLLM parameters they belong in — fused ``qkv_proj``, ``gate_up_proj``, MoE
``w13``/``w2`` included — peer to peer, planned once, with no full-tensor fallback.

``pip install ncclreshard`` registers :func:`register` as a ``vllm.general_plugins`` entry point,
so vLLM's workers know the backend once ``weight_transfer_config={"backend": "ncclreshard"}``
is set; the trainer imports :mod:`ncclreshard.vllm.trainer` (which registers its side) and calls
``WeightTransferTrainerFactory.trainer_init(NcclReshardTrainerInitInfo(...), client=...,
source=DTensorSource(model))`` then ``send_weights()`` every step. Worker side:
:mod:`ncclreshard.vllm.worker`; where each byte lands: :mod:`ncclreshard.vllm.layouts`; the
shared planning: :mod:`ncclreshard.vllm.specs`, :mod:`ncclreshard.vllm.session`.
"""

from __future__ import annotations

BACKEND = "ncclreshard"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: registers the worker and trainer engines under
    ``"ncclreshard"`` (lazily: nothing is imported until vLLM creates one). Does nothing
    without vLLM, and nothing the second time (vLLM may call plugins in several places of one
    process; its factories refuse a name registered twice)."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return
    for factory, module, name in (
        (WeightTransferEngineFactory, "ncclreshard.vllm.worker", "NcclReshardWeightTransferEngine"),
        (WeightTransferTrainerFactory, "ncclreshard.vllm.trainer", "NcclReshardTrainerEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, name)
        except ValueError:  # already registered
            pass


__all__ = ["BACKEND", "register"]
