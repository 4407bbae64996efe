"""Trainer processes and real vLLM workers on the CPU, for refits through vLLM's own
weight-transfer API with the ``ncclreshard`` backend (test_vllm_backend.py). Runs in the
environment of scripts/vllm-venv.sh.

:class:`RefitWorld` spawns its processes once and reuses them for every case (importing vLLM
takes most of a process's start):

- trainer processes form a gloo world of their own and hold the checkpoint
  (vllm_harness.checkpoint) as FSDP2 (``fully_shard``; also through vLLM's own
  ``ModuleSource``), FSDP2 + TP (``parallelize_module`` then ``fully_shard``) or Megatron-style
  tensors (explicit layouts, the recipes' interleaved
  ``linear_qkv`` and gated ``linear_fc1``); they call vLLM's ``WeightTransferTrainerFactory
  .trainer_init`` and ``send_weights``; trainer rank 0's client reaches the workers as vLLM's
  ``collective_rpc`` would, one pipe per worker;
- worker processes build the real vLLM model per case (vllm_harness.build), call
  ``load_general_plugins()`` and ``WeightTransferEngineFactory.create_engine(
  WeightTransferConfig(backend="ncclreshard"), ...)``, and run the engine's methods as vLLM's
  worker does (``parse_init_info`` + ``init_transfer_engine``, ``start_weight_update``,
  ``update_weights``, ``finish_weight_update``). Before every update a worker overwrites every
  byte of every parameter (0xFF: bf16 NaNs; all but an FP8 model's KV-cache scales, which no
  checkpoint of it carries), so the refit must write them all; afterwards
  every parameter must equal, byte for byte, what vLLM's ``load_weights`` of the same
  checkpoint gives in a fresh model (the oracle).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reply(conn: Connection, fn: Any, *args: Any) -> None:
    """Runs fn(*args) and sends ("ok", result) or ("error", traceback)."""
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the controller raises it with this traceback
        conn.send(("error", traceback.format_exc()))


def _recv(conn: Connection, timeout: float, who: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{who}: no answer within {timeout:.0f} s")
    status, value = conn.recv()
    if status != "ok":
        raise RemoteFailure(f"{who}:\n{value}")
    return value


class RemoteFailure(RuntimeError):
    """A command failed in a trainer or worker process; the message has its traceback."""


# -- worker processes ---------------------------------------------------------------------------


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.model: Any = None
        self.vllm_config: Any = None
        self.engine: Any = None
        self.case: Dict[str, Any] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"vllm-world-w{index}-"))
        self.builds = 0
        self.rpc_errors: List[str] = []

    def build(self, model_name: str, tp: int, ep: bool, port: int) -> Dict[str, Any]:
        import torch
        import vllm_harness as harness
        from vllm.config import WeightTransferConfig, set_current_vllm_config
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        from vllm.plugins import load_general_plugins

        self.teardown()
        self.builds += 1
        start = time.perf_counter()
        self.model, self.vllm_config = harness.build(
            model_name, tp, ep, self.index, port, self.workdir / f"case{self.builds}"
        )
        self.case = dict(model=model_name, tp=tp, ep=ep)
        with set_current_vllm_config(self.vllm_config):
            load_general_plugins()  # what vLLM's WorkerBase does: our entry point registers
            # vLLM may run plugins more than once per process; the hook must stay quiet.
            from ncclreshard.vllm import register

            register()
            self.engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend="ncclreshard"), self.vllm_config,
                torch.device("cpu"), self.model,
            )
            ctx = harness.Context(model_name, self.model, self.vllm_config, self.index, tp, ep, 0,
                                  self.workdir, 0.0)
            m2n = harness.m2n_coverage(ctx)
        return {"engine": type(self.engine).__name__, "build_s": time.perf_counter() - start,
                "m2n": (len(m2n.direct), len(m2n.direct) + len(m2n.fallback), m2n.direct_bytes,
                        m2n.total_bytes)}

    def rpc(self, method: str, *args: Any) -> Any:
        try:
            return self._rpc(method, *args)
        except BaseException as e:
            self.rpc_errors.append(f"{method}: {type(e).__name__}: {e}")
            raise

    def errors(self) -> List[str]:
        """The control-plane calls that raised here since the last time asked."""
        out, self.rpc_errors = self.rpc_errors, []
        return out

    def _written(self) -> List[Any]:
        """The parameters a refit writes: all but those the checkpoint does not carry."""
        import vllm_harness as harness

        params = dict(self.model.named_parameters())
        kept = set(harness.unloaded_by_design(self.case["model"], list(params)))
        return [p for n, p in params.items() if n not in kept]

    def untouched(self) -> bool:
        """True when every byte of every parameter still holds what `start` wrote (0xFF)."""
        import torch

        return all(bool((p.data.view(-1).view(torch.uint8) == 0xFF).all()) for p in self._written())

    def _rpc(self, method: str, *args: Any) -> Any:
        """What vLLM's Worker does for each control-plane call (vllm/v1/worker/gpu_worker.py)."""
        import torch
        from vllm.config import set_current_vllm_config

        engine = self.engine
        if engine is None:
            raise RuntimeError("no engine: the case was not built")
        with set_current_vllm_config(self.vllm_config):
            if method == "init":
                engine.init_transfer_engine(engine.parse_init_info(args[0]))
            elif method == "start":
                with torch.no_grad():
                    for p in self._written():
                        p.data.view(torch.uint8).fill_(0xFF)
                engine.start_weight_update()
            elif method == "update":
                engine.update_weights(args[0])
            elif method == "finish":
                engine.finish_weight_update()
                engine.reset_weight_update_target()
            else:
                raise ValueError(f"unknown rpc {method!r}")
        return {"transfer_s": getattr(engine, "last_transfer_s", 0.0)}

    def verify(self, seed: int) -> Dict[str, Any]:
        """Every parameter against vLLM's load_weights of the same checkpoint in a fresh model."""
        import torch
        import vllm_harness as harness
        from vllm.config import set_current_vllm_config

        c = self.case
        oracle_config = harness.configure(c["model"], c["tp"], c["ep"],
                                          self.workdir / f"oracle{self.builds}-{seed}", self.index)
        with set_current_vllm_config(oracle_config):
            oracle = harness.new_model(oracle_config)
            loaded = set(oracle.load_weights(iter(harness.checkpoint(c["model"], seed).items())))
        expected = dict(oracle.named_parameters())
        got = dict(self.model.named_parameters())
        loaded |= set(harness.unloaded_by_design(c["model"], list(expected)))
        if set(expected) != set(got) or set(expected) - loaded:
            raise AssertionError(f"parameter sets differ: {sorted(set(expected) ^ set(got))} / "
                                 f"unloaded {sorted(set(expected) - loaded)}")
        checked = 0
        for name, want in expected.items():
            a, b = want.data.view(-1).view(torch.uint8), got[name].data.view(-1).view(torch.uint8)
            if a.shape != b.shape or not torch.equal(a, b):
                bad = (a != b).nonzero()[0].item() if a.shape == b.shape else -1
                raise AssertionError(
                    f"rank {self.index} {name} {list(got[name].shape)}: differs from load_weights "
                    f"at byte {bad} of {a.numel()}"
                )
            checked += a.numel()
        session = self.engine.session
        return {"params": len(expected), "bytes": checked,
                "plans": session.plans_made if session is not None else 0}

    def shutdown_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def teardown(self) -> None:
        import vllm_harness as harness

        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.model is not None:
            self.model = None
            harness.teardown()


def _worker_main(index: int, ctrl: Connection, rpc: Connection) -> None:
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    worker = _Worker(index)
    ctrl.send(("ok", "ready"))
    while True:
        for conn in wait([ctrl, rpc]):
            message = conn.recv()
            command, args = message[0], message[1:]
            if conn is rpc:
                _reply(rpc, worker.rpc, command, *args)
            elif command == "stop":
                worker.teardown()
                ctrl.send(("ok", None))
                return
            else:
                _reply(ctrl, getattr(worker, command), *args)


# -- trainer processes --------------------------------------------------------------------------


class PipeClient:
    """vLLM's control plane as trainer rank 0 sees it (a VLLMWeightSyncClient): each call goes to
    every worker and waits for all, as ``collective_rpc`` does."""

    def __init__(self, conns: Sequence[Connection], timeout: float) -> None:
        self.conns = list(conns)
        self.timeout = timeout
        self.transfer_s: List[float] = []

    def _call(self, *message: Any) -> List[Any]:
        for c in self.conns:
            c.send(message)
        results, errors = [], []
        for i, c in enumerate(self.conns):
            try:
                results.append(_recv(c, self.timeout, f"worker {i} {message[0]}"))
            except (RemoteFailure, TimeoutError) as e:
                errors.append(str(e))
        if errors:
            raise RemoteFailure("\n".join(errors))
        return results

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self._call("init", init_info)

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info: Any) -> None:
        self.transfer_s = [r["transfer_s"] for r in self._call("update", update_info)]

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._call("finish")


def _tensor_parallel_plan(names: Sequence[str]) -> Dict[str, Any]:
    """FSDP2 + TP's TP half, as a trainer of an HF model sets it: column-parallel q/k/v and
    gate/up (also of each expert and the shared expert), row-parallel o/down."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: Dict[str, Any] = {}
    for name in names:
        module, leaf = name.rsplit(".", 1)
        if leaf != "weight":
            continue
        last = module.rsplit(".", 1)[-1]
        if last in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            plan[module] = ColwiseParallel()
        elif last in ("o_proj", "down_proj"):
            plan[module] = RowwiseParallel()
    return plan


def _module_tree(tensors: Dict[str, Any]) -> Any:
    """An nn.Module whose parameters carry the checkpoint's names; Linear modules where TP
    needs them (parallelize_module wants nn.Linear)."""
    import torch

    root = torch.nn.Module()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for i, part in enumerate(path):
            if not hasattr(module, part):
                is_linear = i == len(path) - 1 and value.dim() == 2 and leaf in ("weight", "bias")
                child = torch.nn.Linear(1, 1, bias=False) if is_linear else torch.nn.Module()
                setattr(module, part, child)
            module = getattr(module, part)
        if isinstance(module, torch.nn.Linear) and leaf == "weight":
            module.in_features, module.out_features = value.shape[1], value.shape[0]
        setattr(module, leaf, torch.nn.Parameter(value.clone(), requires_grad=False))
    return root


def _sharded(kind: str, tensors: Dict[str, Any], world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    module = _module_tree(tensors)
    if kind == "fsdp2":
        fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    elif kind == "fsdp2+tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(module, mesh["tp"], _tensor_parallel_plan(list(tensors)))
        fully_shard(module, mesh=mesh["dp"])
    else:
        raise ValueError(kind)
    return module


class _Megatron:
    """Megatron-style trainer tensors for a dense Qwen3 checkpoint: TP 2 within each pair of
    trainer ranks (DP replicas across pairs); interleaved linear_qkv and gated linear_fc1 (the
    recipes' source views), row-parallel proj/fc2, vocabulary padded to 128 x TP and split in
    blocks, norms replicated. Local tensors are computed from the full checkpoint here,
    independently of the library."""

    TP = 2

    def __init__(self, model_name: str, rank: int) -> None:
        import vllm_harness as harness

        self.config = harness.MODELS[model_name]
        self.rank = rank
        self.tp_rank = rank % self.TP
        self.group = [rank - self.tp_rank + i for i in range(self.TP)]
        self.locals: Dict[str, Any] = {}

    def fill(self, ckpt: Dict[str, Any]) -> None:
        """This rank's Megatron parameters from checkpoint `ckpt` (in place after the first)."""
        import torch

        c, t, tp = self.config, self.tp_rank, self.TP
        hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        heads, groups = c["num_attention_heads"], c["num_key_value_heads"]
        per_group = heads // groups
        vocab_rows = math.ceil(c["vocab_size"] / (128 * tp)) * 128
        new: Dict[str, Any] = {}
        for name, w in ckpt.items():
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                local = torch.zeros((vocab_rows,) + tuple(w.shape[1:]), dtype=w.dtype)
                part = w[t * vocab_rows:(t + 1) * vocab_rows]
                local[: part.shape[0]] = part
                new[name] = local
            elif name.endswith("q_proj.weight"):
                base = name[: -len("q_proj.weight")]
                q, k, v = (ckpt[base + p + "_proj.weight"] for p in "qkv")
                rows = []
                for g in range(t * groups // tp, (t + 1) * groups // tp):
                    rows += [q[g * per_group * hd:(g + 1) * per_group * hd], k[g * hd:(g + 1) * hd],
                             v[g * hd:(g + 1) * hd]]
                new[base + "linear_qkv"] = torch.cat(rows)
            elif name.endswith("gate_proj.weight"):
                base = name[: -len("gate_proj.weight")]
                n = w.shape[0] // tp
                new[base + "linear_fc1"] = torch.cat([w[t * n:(t + 1) * n],
                                                      ckpt[base + "up_proj.weight"][t * n:(t + 1) * n]])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                n = w.shape[1] // tp
                new[name] = w[:, t * n:(t + 1) * n].contiguous()
            elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
                continue
            else:
                new[name] = w.clone()
        if not self.locals:
            self.locals = new
        else:
            for k, v in new.items():
                self.locals[k].copy_(v)

    def source(self, ckpt: Dict[str, Any]) -> Any:
        import ncclreshard as nr
        from ncclreshard import recipes
        from ncclreshard.vllm.trainer import TensorSource, TrainerTensor, recipe_tensors

        c, tp = self.config, self.TP
        hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        vocab_rows = math.ceil(c["vocab_size"] / (128 * tp)) * 128
        tensors: List[Any] = []
        for name, w in ckpt.items():
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                layout = nr.Layout([tp], self.group, [nr.ShardBlocks(0, vocab_rows)])
                held = nr.local_shape(layout, w.shape, self.rank)[0]
                tensors.append(TrainerTensor(name, tuple(w.shape), w.dtype, layout,
                                             lambda n=name, h=held: self.locals[n][:h]))
            elif name.endswith("q_proj.weight"):
                base = name[: -len("q_proj.weight")]
                recipe = recipes.megatron_qkv_to_vllm(
                    base + "linear_qkv", "unused", self.group, self.group,
                    num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                    head_dim=hd, hidden_size=c["hidden_size"], dtype=w.dtype,
                )
                names = {f"unused.{p}": f"{base}{p}_proj.weight" for p in "qkv"}
                tensors += recipe_tensors(recipe, names, self.locals, self.rank)
            elif name.endswith("gate_proj.weight"):
                base = name[: -len("gate_proj.weight")]
                recipe = recipes.megatron_fc1_to_vllm(
                    base + "linear_fc1", "unused", self.group, self.group,
                    ffn_hidden_size=w.shape[0], hidden_size=w.shape[1], dtype=w.dtype,
                )
                names = {"unused.gate": base + "gate_proj.weight", "unused.up": base + "up_proj.weight"}
                tensors += recipe_tensors(recipe, names, self.locals, self.rank)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                layout = nr.Layout([tp], self.group, [nr.Shard(1)])
                tensors.append(TrainerTensor(name, tuple(w.shape), w.dtype, layout,
                                             lambda n=name: self.locals[n]))
            elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
                continue
            else:
                layout = nr.Layout([tp], self.group, [nr.Replicate()])
                tensors.append(TrainerTensor(name, tuple(w.shape), w.dtype, layout,
                                             lambda n=name: self.locals[n]))
        return TensorSource(tensors)


class _Trainer:
    def __init__(self, rank: int, world: int, rpc: Sequence[Connection], timeout: float) -> None:
        self.rank, self.world = rank, world
        self.rpc = list(rpc)
        self.timeout = timeout
        self.engine: Any = None
        self.module: Any = None
        self.megatron: Optional[_Megatron] = None
        self.case: Dict[str, Any] = {}

    def _checkpoint(self, seed: int, drop: Sequence[str] = (), edits: Dict[str, Any] = None) -> Dict[str, Any]:
        import vllm_harness as harness

        ckpt = harness.trainer_checkpoint(self.case["model"], seed)
        for name in drop:
            ckpt.pop(name)
        for name, fn in (edits or {}).items():
            ckpt[name] = fn(ckpt.get(name))
        return ckpt

    def start(self, model_name: str, kind: str, workers: int, port: int, seed: int,
              options: Dict[str, Any]) -> Dict[str, Any]:
        """trainer_init for a case: the checkpoint of `seed` as `kind` tensors."""
        # Importing the trainer module registers the trainer engine with vLLM's factory.
        from ncclreshard.vllm.trainer import DTensorSource, NcclReshardTrainerInitInfo
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        self.stop_engine()
        self.case = dict(model=model_name, kind=kind, drop=options.pop("drop", ()),
                         edits=_EDITS.get(options.pop("edit", None), {}))
        ckpt = self._checkpoint(seed, self.case["drop"], self.case["edits"])
        if kind == "megatron":
            self.megatron = _Megatron(model_name, self.rank)
            self.megatron.fill(ckpt)
            source = self.megatron.source(ckpt)
        elif kind == "vllm-source":
            # vLLM's own WeightSource over FSDP2 parameters (metadata + iter_local).
            from vllm.distributed.weight_transfer import ModuleSource

            self.module = _sharded("fsdp2", ckpt, self.world)
            source = ModuleSource(self.module)
        else:
            self.module = _sharded(kind, ckpt, self.world)
            source = DTensorSource(self.module)
        info = NcclReshardTrainerInitInfo(
            rank=self.rank, master_address="127.0.0.1", master_port=port,
            num_trainer_ranks=self.world, world_size=self.world + workers, **options,
        )
        client = PipeClient(self.rpc[:workers], self.timeout) if self.rank == 0 else None
        start = time.perf_counter()
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        return {"init_s": time.perf_counter() - start}

    def send(self, seed: int, names: Optional[List[str]] = None) -> Dict[str, Any]:
        """One refit of the checkpoint of `seed`: the trainer's tensors are updated in place
        (as an optimizer step does), then send_weights."""
        import torch

        ckpt = self._checkpoint(seed, self.case["drop"], self.case["edits"])
        if self.megatron is not None:
            if "corrupt" not in self.case:
                self.megatron.fill(ckpt)
        elif self.case["kind"] == "replicated":
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    p.to_local().copy_(ckpt[name])
        else:
            kind = "fsdp2" if self.case["kind"] == "vllm-source" else self.case["kind"]
            fresh = _sharded(kind, ckpt, self.world)
            new = dict(fresh.named_parameters())
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    p.to_local().copy_(new[name].to_local())
        start = time.perf_counter()
        self.engine.send_weights(names)
        seconds = time.perf_counter() - start
        client = self.engine.client
        return {"send_s": seconds, "transfer_s": self.engine.last_transfer_s,
                "worker_transfer_s": getattr(client, "transfer_s", []),
                "plans": self.engine.session.plans_made, "epoch": self.engine.epoch}

    def relayout(self) -> None:
        """Replaces every parameter by its DTensor redistributed to Replicate() (a trainer that
        changed its sharding): the next send declares anew and plans once more."""
        import torch
        from torch.distributed.tensor import Replicate

        for name, p in list(self.module.named_parameters()):
            owner = self.module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.module
            whole = p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(whole, requires_grad=False))
        self.case["kind"] = "replicated"

    def corrupt(self, name: str) -> None:
        """Replaces this rank's Megatron tensor `name` by one a row short (a bug in the
        trainer's code): its next send must be refused on every rank."""
        assert self.megatron is not None
        held = self.megatron.locals[name]
        self.megatron.locals[name] = held[:-1].clone()
        self.case["corrupt"] = name

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        self.module = None
        self.megatron = None


def _unknown(_: Any) -> Any:
    import torch

    return torch.zeros(4, 4, dtype=torch.bfloat16)


def _narrower(w: Any) -> Any:
    return w[:, :-8].contiguous()


def _float32(w: Any) -> Any:
    return w.float()


def _float8(w: Any) -> Any:
    import torch

    return w.to(torch.float8_e4m3fn)


def _groups_of_100(w: Any) -> Any:
    return w.reshape(11, 100, w.shape[1])


# Edits of a trainer's checkpoint that bad-input tests make, by name (options travel pickled).
_EDITS: Dict[str, Dict[str, Any]] = {
    "unknown": {"model.layers.0.self_attn.nonsense.weight": _unknown},
    "shape": {"model.layers.1.mlp.down_proj.weight": _narrower},
    "dtype": {"model.norm.weight": _float32},
    # Declared as [11, 100, hidden]: vLLM's vocabulary shards (rows [0, 576) at TP 2) cut groups.
    "cut": {"model.embed_tokens.weight": _groups_of_100},
    # An FP8 model's weight sent already in FP8: the backend quantizes bf16/fp16/fp32 only.
    "fp8": {"model.layers.0.self_attn.q_proj.weight": _float8},
}


def _trainer_main(rank: int, world: int, dist_port: int, ctrl: Connection, rpc: Sequence[Connection],
                  timeout: float) -> None:
    sys.path.insert(0, str(HERE))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    trainer = _Trainer(rank, world, rpc, timeout)
    ctrl.send(("ok", "ready"))
    while True:
        command, *args = ctrl.recv()
        if command == "stop":
            trainer.stop_engine()
            ctrl.send(("ok", None))
            return
        _reply(ctrl, getattr(trainer, command), *args)


# -- the controller ------------------------------------------------------------------------------


@dataclasses.dataclass
class CaseResult:
    label: str
    params: int
    bytes: int
    steps: List[Dict[str, Any]]
    m2n: Tuple[int, int, int, int]
    seconds: float
    plans: List[int]


class RefitWorld:
    """`trainers` trainer processes and `workers` vLLM worker processes (spawned once; a case
    uses the first `tp` workers). Close it (or use it in a ``with``) to stop them."""

    def __init__(self, trainers: int = 4, workers: int = 4, timeout: float = 300.0) -> None:
        self.trainers, self.workers, self.timeout = trainers, workers, timeout
        context = mp.get_context("spawn")
        self._procs: List[Any] = []
        self._worker_ctrl: List[Connection] = []
        self._trainer_ctrl: List[Connection] = []
        rpc_pairs = [context.Pipe() for _ in range(workers)]
        start = time.perf_counter()
        for i in range(workers):
            mine, theirs = context.Pipe()
            p = context.Process(target=_worker_main, args=(i, theirs, rpc_pairs[i][1]),
                                name=f"vllm-worker{i}", daemon=True)
            p.start()
            self._procs.append(p)
            self._worker_ctrl.append(mine)
        port = free_port()
        for r in range(trainers):
            mine, theirs = context.Pipe()
            rpc = [a for a, _ in rpc_pairs] if r == 0 else []
            p = context.Process(target=_trainer_main, args=(r, trainers, port, theirs, rpc, timeout),
                                name=f"trainer{r}", daemon=True)
            p.start()
            self._procs.append(p)
            self._trainer_ctrl.append(mine)
        for i, c in enumerate(self._worker_ctrl):
            _recv(c, timeout, f"worker {i} start")
        for r, c in enumerate(self._trainer_ctrl):
            _recv(c, timeout, f"trainer {r} start")
        self.start_s = time.perf_counter() - start

    def _all(self, conns: Sequence[Connection], message: Tuple[Any, ...], who: str) -> List[Any]:
        for c in conns:
            c.send(message)
        results, errors = [], []
        for i, c in enumerate(conns):
            try:
                results.append(_recv(c, self.timeout, f"{who} {i} {message[0]}"))
            except (RemoteFailure, TimeoutError) as e:
                errors.append(str(e))
        if errors:
            raise RemoteFailure("\n".join(errors))
        return results

    def build(self, model: str, tp: int, ep: bool = False) -> List[Dict[str, Any]]:
        return self._all(self._worker_ctrl[:tp], ("build", model, tp, ep, free_port()), "worker")

    def start(self, model: str, kind: str, tp: int, seed: int, **options: Any) -> List[Dict[str, Any]]:
        """trainer_init on every trainer (and through the client, init on the workers)."""
        port = free_port()
        # Ranks wait for one another's verdicts this long: well within the controller's timeout,
        # so a rank that never reports fails the case instead of desynchronising the pipes.
        options.setdefault("store_timeout_s", self.timeout / 5)
        return self._all(self._trainer_ctrl, ("start", model, kind, tp, port, seed, dict(options)), "trainer")

    def send(self, seed: int, names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        return self._all(self._trainer_ctrl, ("send", seed, names), "trainer")

    def verify(self, tp: int, seed: int) -> List[Dict[str, Any]]:
        return self._all(self._worker_ctrl[:tp], ("verify", seed), "worker")

    def errors(self, tp: int) -> List[List[str]]:
        """Each worker's control-plane errors since the last call."""
        return self._all(self._worker_ctrl[:tp], ("errors",), "worker")

    def untouched(self, tp: int) -> List[bool]:
        return self._all(self._worker_ctrl[:tp], ("untouched",), "worker")

    def relayout(self) -> None:
        self._all(self._trainer_ctrl, ("relayout",), "trainer")

    def corrupt(self, rank: int, name: str) -> None:
        self._trainer_ctrl[rank].send(("corrupt", name))
        _recv(self._trainer_ctrl[rank], self.timeout, f"trainer {rank} corrupt")

    def stop_engines(self, tp: int) -> None:
        self._all(self._worker_ctrl[:tp], ("shutdown_engine",), "worker")
        self._all(self._trainer_ctrl, ("stop_engine",), "trainer")

    def refit(self, model: str, tp: int, ep: bool, kind: str, seeds: Sequence[int], **options: Any) -> CaseResult:
        """A whole case: build, trainer_init, a refit per seed, each verified on every worker
        against load_weights; the engines stopped after."""
        start = time.perf_counter()
        built = self.build(model, tp, ep)
        self.start(model, kind, tp, seeds[0], **options)
        steps, plans = [], []
        checked = (0, 0)
        try:
            for seed in seeds:
                sent = self.send(seed)
                verified = self.verify(tp, seed)
                checked = (sum(v["params"] for v in verified), sum(v["bytes"] for v in verified))
                steps.append({"seed": seed, "send_s": max(s["send_s"] for s in sent),
                              "transfer_s": max(s["transfer_s"] for s in sent)})
                plans.append(max([s["plans"] for s in sent] + [v["plans"] for v in verified]))
        finally:
            self.stop_engines(tp)
        label = f"{model} TP {tp}{' EP' if ep else ''} from {kind}"
        return CaseResult(label, checked[0], checked[1], steps, tuple(built[0]["m2n"]),
                          time.perf_counter() - start, plans)

    def close(self) -> None:
        for c in self._worker_ctrl + self._trainer_ctrl:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 30
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> "RefitWorld":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
