"""Refit a real vLLM model from FSDP2 trainers through vLLM's weight-transfer API, with the
``ncclreshard`` backend.

Trainer ranks hold a small Qwen3 model's weights as FSDP2 DTensors (``fully_shard``; FSDP2 +
TP with ``--trainer-tp 2``); vLLM worker ranks build the real vLLM model (TP ``--tp``: KV heads
replicated at TP 4, the padded vocabulary split in blocks). vLLM loads the backend through its
plugin entry point (``load_general_plugins``) and creates it with
``WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="ncclreshard"), ...)``;
the trainers call ``WeightTransferTrainerFactory.trainer_init(NcclReshardTrainerInitInfo(...),
client=..., source=DTensorSource(model))`` and ``send_weights()`` after each "training step".
Trainer rank 0's client stands in for vLLM's control plane (``LLM``/HTTP ``collective_rpc``):
it posts each call to every worker through a store and waits for them, as vLLM's RPCs do.
After each refit every worker compares every parameter, byte for byte, with what vLLM's own
``load_weights`` of the same weights gives in a fresh model; the run ends with "verified".

CPU (every rank a process: trainers over gloo, the refit on the torch transport):

    python python/examples/vllm_refit.py --cpu

GPUs (one process per GPU, trainers first; the refit on the library's NCCL executor, or
``--transport torch`` for torch's NCCL). Not run by CI (no GPU there); vLLM must be able to
build the model on the GPU:

    torchrun --nproc-per-node=4 python/examples/vllm_refit.py --trainers 2 --tp 2

Needs vLLM 0.33 and ``pip install ./python`` (scripts/vllm-venv.sh makes such an environment).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu" if "--cpu" in sys.argv else "cuda")

# A tiny Qwen3: 8 query heads and 2 KV heads of 16, vocabulary 1100 (vLLM pads it to 1152).
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1100, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def checkpoint(step: int) -> Dict[str, Any]:
    """The Hugging Face checkpoint after training step `step` (every process makes the same)."""
    import torch

    c, hd = CONFIG, CONFIG["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (c["num_attention_heads"] * hd, c["hidden_size"]),
            f"{p}.self_attn.k_proj.weight": (c["num_key_value_heads"] * hd, c["hidden_size"]),
            f"{p}.self_attn.v_proj.weight": (c["num_key_value_heads"] * hd, c["hidden_size"]),
            f"{p}.self_attn.o_proj.weight": (c["hidden_size"], c["num_attention_heads"] * hd),
            f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.mlp.gate_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            f"{p}.mlp.up_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            f"{p}.mlp.down_proj.weight": (c["hidden_size"], c["intermediate_size"]),
            f"{p}.input_layernorm.weight": (c["hidden_size"],),
            f"{p}.post_attention_layernorm.weight": (c["hidden_size"],),
        })
    shapes["model.norm.weight"] = (c["hidden_size"],)
    shapes["lm_head.weight"] = (c["vocab_size"], c["hidden_size"])
    out = {}
    for name, shape in shapes.items():
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
        out[name] = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    return out


class Control:
    """The control plane over a store: trainer rank 0 posts a call, every worker runs it and
    answers (vLLM's own would be ``LLM.collective_rpc`` or its HTTP routes)."""

    def __init__(self, store: Any, workers: int) -> None:
        self.store, self.workers, self.calls = store, workers, 0

    def post(self, method: str, arg: Any = None) -> List[Any]:
        n, self.calls = self.calls, self.calls + 1
        self.store.set(f"call/{n}", json.dumps([method, arg]))
        answers = [json.loads(self.store.get(f"answer/{n}/{w}")) for w in range(self.workers)]
        errors = [a["error"] for a in answers if a.get("error")]
        if errors:
            raise RuntimeError(f"{method} failed on a worker:\n" + "\n".join(errors))
        return answers

    # vLLM's VLLMWeightSyncClient protocol, as the trainer engine calls it.
    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self.post("init", init_info)

    def start_weight_update(self) -> None:
        self.post("start")

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        self.post("update", update_info)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.post("finish")


def trainer(rank: int, args: argparse.Namespace, control: Optional[Control], device: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from ncclreshard.vllm.trainer import DTensorSource, NcclReshardTrainerInitInfo  # registers the engine

    dist.init_process_group("gloo" if args.cpu else "nccl", init_method=f"tcp://{args.host}:{args.ports[1]}",
                            rank=rank, world_size=args.trainers, timeout=timedelta(seconds=300))

    def model_of(weights: Dict[str, torch.Tensor]) -> torch.nn.Module:
        """An HF-named module tree with nn.Linear where TP needs one, FSDP2 (+ TP) applied."""
        root = torch.nn.Module()
        for name, value in weights.items():
            *path, leaf = name.split(".")
            module = root
            for i, part in enumerate(path):
                if not hasattr(module, part):
                    setattr(module, part, torch.nn.Linear(1, 1, bias=False) if i == len(path) - 1 and value.dim() == 2
                            else torch.nn.Module())
                module = getattr(module, part)
            setattr(module, leaf, torch.nn.Parameter(value.to(device), requires_grad=False))
        kind = device.type
        if args.trainer_tp > 1:
            mesh = init_device_mesh(kind, (args.trainers // args.trainer_tp, args.trainer_tp), mesh_dim_names=("dp", "tp"))
            plan = {n.rsplit(".", 1)[0]: ColwiseParallel() if any(k in n for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
                    else RowwiseParallel() for n in weights if n.endswith(("_proj.weight",))}
            parallelize_module(root, mesh["tp"], plan)
            fully_shard(root, mesh=mesh["dp"])
        else:
            fully_shard(root, mesh=init_device_mesh(kind, (args.trainers,)))
        return root

    model = model_of(checkpoint(0))
    info = NcclReshardTrainerInitInfo(
        rank=rank, master_address=args.host, master_port=args.ports[2],
        num_trainer_ranks=args.trainers, world_size=args.trainers + args.tp,
        transport="torch" if args.cpu else args.transport, timeout_ms=60000,
        device=str(device),
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=control, source=DTensorSource(model))
    for step in range(1, args.steps + 1):
        # The "optimizer step": this rank's shards take the new weights in place.
        fresh = dict(model_of(checkpoint(step)).named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(fresh[name].to_local())
        start = time.perf_counter()
        engine.send_weights()
        if rank == 0:
            assert control is not None
            checked = control.post("verify", step)
            print(f"step {step}: refit in {time.perf_counter() - start:.3f} s (plans made: "
                  f"{engine.session.plans_made}); {sum(c['params'] for c in checked)} parameters, "
                  f"{sum(c['bytes'] for c in checked)} bytes on {args.tp} vLLM ranks equal load_weights",
                  flush=True)
    if rank == 0:
        assert control is not None
        control.post("stop")
        print(f"every parameter of every vLLM rank verified against load_weights after each of "
              f"{args.steps} refits", flush=True)
    engine.shutdown()
    dist.destroy_process_group()


def worker(index: int, args: argparse.Namespace, store: Any, device: Any) -> None:
    import torch
    from vllm.config import (LoadConfig, ModelConfig, ParallelConfig, VllmConfig, WeightTransferConfig,
                             set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import set_default_torch_dtype

    workdir = Path(tempfile.mkdtemp(prefix=f"vllm-refit-{index}-"))

    def config(tag: str) -> VllmConfig:
        (workdir / tag).mkdir()
        (workdir / tag / "config.json").write_text(json.dumps(CONFIG))
        parallel = ParallelConfig(tensor_parallel_size=args.tp)
        parallel.rank = index  # as vLLM's Worker sets it
        return VllmConfig(model_config=ModelConfig(model=str(workdir / tag), skip_tokenizer_init=True,
                                                   enforce_eager=True, dtype="bfloat16"),
                          parallel_config=parallel, load_config=LoadConfig(load_format="dummy"))

    def build(vllm_config: VllmConfig) -> torch.nn.Module:
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16), device:
            return initialize_model(vllm_config=vllm_config)

    vllm_config = config("model")
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=args.tp, rank=index, local_rank=index,
                                     distributed_init_method=f"tcp://{args.host}:{args.ports[3]}",
                                     backend="gloo" if args.cpu else "nccl")
        initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model = build(vllm_config)
    load_general_plugins()  # vLLM's worker does this; our entry point registers "ncclreshard"
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="ncclreshard"),
                                                       vllm_config, device, model)
    for n in range(1 << 30):
        method, arg = json.loads(store.get(f"call/{n}"))
        answer: Dict[str, Any] = {}
        try:
            with set_current_vllm_config(vllm_config):
                if method == "init":
                    engine.init_transfer_engine(engine.parse_init_info(arg))
                elif method == "start":
                    engine.start_weight_update()
                elif method == "update":
                    engine.update_weights(arg)
                elif method == "finish":
                    engine.finish_weight_update()
                elif method == "verify":
                    oracle = build(config(f"oracle{arg}"))
                    oracle.load_weights(iter(checkpoint(arg).items()))
                    expected, got = dict(oracle.named_parameters()), dict(model.named_parameters())
                    assert expected.keys() == got.keys(), sorted(expected.keys() ^ got.keys())
                    for name, want in expected.items():
                        if not torch.equal(want.data.view(-1).view(torch.uint8), got[name].data.view(-1).view(torch.uint8)):
                            raise AssertionError(f"{name} differs from load_weights")
                    answer = {"params": len(got), "bytes": sum(p.numel() * p.element_size() for p in got.values())}
        except BaseException:  # noqa: BLE001 - trainer rank 0 raises it
            answer = {"error": f"vLLM rank {index}:\n{traceback.format_exc()}"}
        store.set(f"answer/{n}/{index}", json.dumps(answer))
        if method == "stop":
            break
    engine.shutdown()


def main(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = args.trainers + args.tp
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    store = dist.TCPStore(args.host, args.ports[0], world, rank == 0, timeout=timedelta(seconds=600))
    if rank < args.trainers:
        trainer(rank, args, Control(store, args.tp) if rank == 0 else None, device)
    else:
        worker(rank - args.trainers, args, store, device)


def _child(rank: int, args: argparse.Namespace, failures: Any) -> None:
    try:
        main(rank, args)
    except BaseException:  # noqa: BLE001 - reported by the parent
        failures.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="every rank a CPU process (gloo, torch transport)")
    parser.add_argument("--trainers", type=int, default=2, help="trainer ranks (FSDP2)")
    parser.add_argument("--trainer-tp", type=int, default=1, help="TP within the trainers (FSDP2 + TP)")
    parser.add_argument("--tp", type=int, default=2, help="vLLM's tensor-parallel size (vLLM ranks)")
    parser.add_argument("--steps", type=int, default=2, help="training steps, each followed by a refit")
    parser.add_argument("--transport", choices=["nccl", "torch"], default="nccl", help="on GPUs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0,
                        help="torchrun: the first of 4 ports (default: MASTER_PORT + 1); --cpu picks free ones")
    args = parser.parse_args()
    if args.trainers % args.trainer_tp:
        parser.error("--trainers must be a multiple of --trainer-tp")
    if "RANK" in os.environ:  # torchrun: this process is one rank
        first = args.port or int(os.environ.get("MASTER_PORT", "29500")) + 1
        args.ports = [first + i for i in range(4)]
        main(int(os.environ["RANK"]), args)
        sys.exit(0)
    if not args.cpu:
        parser.error("without --cpu, start it with torchrun (one process per GPU)")
    args.ports = [_free_port() for _ in range(4)]
    context = mp.get_context("spawn")
    failures = context.Queue()
    ranks = [context.Process(target=_child, args=(r, args, failures)) for r in range(args.trainers + args.tp)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=900)
    hung = [p for p in ranks if p.is_alive()]
    for p in hung:
        p.kill()
    if hung or any(p.exitcode != 0 for p in ranks):
        while not failures.empty():
            print(failures.get(), file=sys.stderr)
        sys.exit(f"failed: exit codes {[p.exitcode for p in ranks]}{', some killed after 900 s' if hung else ''}")
