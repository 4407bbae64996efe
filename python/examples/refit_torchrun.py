"""Weight refit, trainer → inference, with ncclreshard.

A trainer group and an inference group in one job. The trainer holds a transformer layer's
weights as DTensors sharded FSDP2 + TP (``[_StridedShard(0, tp), Shard(0)]`` for column-parallel
weights, ``[Shard(0), Shard(1)]`` for row-parallel ones) on a dp × tp mesh; the inference
ranks hold vLLM-style TP parameters, fused (``qkv_proj``, ``gate_up_proj``) and plain
(``o_proj``, ``down_proj``). One communicator spans both groups (``init_comm``, the way RL stacks
build their weight-update group), every rank makes one plan from the same specs, and each
step the trainer updates its shards and the plan moves them straight into the inference
parameters. At the end every inference byte is checked against what vLLM's loaders make of
the trainer's final weights.

On GPUs (one process per GPU, at least 2 for separate groups; 1 GPU colocates them):

    torchrun --nproc-per-node=8 python/examples/refit_torchrun.py --steps 3

Without GPUs, on the CPU emulation of CUDA and NCCL (``bash scripts/build-emulator.sh``; it
needs a real NVRTC for the copy kernel: ``NCCL_RESHARD_NVRTC_LIBRARY``): every rank is a thread
of one process (the emulator's NCCL is in-process), torch's own CUDA kernels cannot run there,
so device memory comes from the emulated cudart through ctypes and the views are raw pointers
checked against the plan on CPU twins first:

    python python/examples/refit_torchrun.py --emulated target/emu/lib --ranks 8 --steps 3

Surviving a failure (docs/resilience.md), on the emulator: ``--kill 5 --kill-step 1`` makes
inference rank 5 die before its call of step 1. Every call after the warm-up step 0 has a
deadline (``--timeout-ms``);
after each step the ranks report to the store and rank 0 (a trainer) decides who is gone; the
survivors shrink the communicator, plan for themselves (``Config(failed_ranks=...)``), redo the
step and go on; every surviving inference byte is checked at the end:

    python python/examples/refit_torchrun.py --emulated target/emu/lib --ranks 8 --steps 3 --kill 5
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from typing import Dict, List, Tuple


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="refits to run")
    parser.add_argument("--emulated", metavar="DIR", help="run on the emulator in DIR (target/emu/lib)")
    parser.add_argument("--ranks", type=int, default=8, help="emulated ranks (threads)")
    parser.add_argument("--kill", type=int, metavar="RANK", help="an inference rank that dies (emulated)")
    parser.add_argument("--kill-step", type=int, default=1, help="the step before whose call it dies")
    parser.add_argument("--timeout-ms", type=int, default=2000, help="each call's deadline with --kill")
    return parser.parse_args()


ARGS = _parse()
if ARGS.emulated:
    lib_dir = os.path.abspath(ARGS.emulated)
    # The library's driver lookup reads the loader path at start-up; torch must load lazily so
    # that its NCCL references bind to the emulator's NCCL mapped first (one NCCL per process).
    if os.environ.get("LD_LIBRARY_PATH", "").split(":")[0] != lib_dir:
        env = dict(os.environ, LD_LIBRARY_PATH=f"{lib_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
                   TORCH_USE_RTLD_GLOBAL="1")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    ctypes.CDLL(os.path.join(lib_dir, "libnccl.so.2"), mode=os.RTLD_GLOBAL)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

import ncclreshard as nr  # noqa: E402
from ncclreshard import recipes  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN = 8, 4, 16, 128, 256
DTYPE = torch.bfloat16
COLUMN = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]  # output dim sharded by TP
ROW = ["o_proj", "down_proj"]  # input dim sharded by TP


def initial_weights() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN), "down_proj": (HIDDEN, FFN)}
    return {k: torch.randn(*s, generator=g).to(DTYPE) for k, s in shapes.items()}


def train_step(tensor: torch.Tensor, step: int) -> None:
    """The 'optimizer': an elementwise update, so shards and the global tensor agree bytewise."""
    tensor.add_(0.25 * (step + 1))


def groups(world: int) -> Tuple[List[int], Tuple[int, int], List[int]]:
    """(trainer ranks, trainer mesh (dp, tp), inference ranks); one rank colocates both."""
    if world == 1:
        return [0], (1, 1), [0]
    trainers = world // 2
    tp = 2 if trainers % 2 == 0 else 1
    return list(range(trainers)), (trainers // tp, tp), list(range(trainers, world))


def trainer_shards(weights: Dict[str, torch.Tensor], mesh: DeviceMesh) -> Tuple[Dict[str, torch.Tensor], Dict[str, nr.Layout]]:
    """This rank's FSDP2 + TP shards (DTensor's own placement) and every weight's layout."""
    tp = mesh.mesh.shape[1]
    local, layouts = {}, {}
    for name, weight in weights.items():
        placements = [_StridedShard(0, split_factor=tp), Shard(0)] if name in COLUMN else [Shard(0), Shard(1)]
        dtensor = distribute_tensor(weight.to(mesh.device_type), mesh, placements, src_data_rank=None)
        local[name] = dtensor.to_local()
        layouts[name] = nr.Layout.from_dtensor(dtensor)
    return local, layouts


def plan_recipe(layouts: Dict[str, nr.Layout], infer: List[int]) -> recipes.Recipe:
    """The inference side: vLLM's fused qkv_proj/gate_up_proj and row-parallel o_proj/down_proj."""
    common = dict(hidden_size=HIDDEN, dtype=DTYPE)
    recipe = recipes.hf_qkv_to_vllm(
        ("q_proj", layouts["q_proj"]), ("k_proj", layouts["k_proj"]), ("v_proj", layouts["v_proj"]),
        "qkv_proj", infer, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, **common)
    recipe += recipes.hf_gate_up_to_vllm(("gate_proj", layouts["gate_proj"]), ("up_proj", layouts["up_proj"]),
                                         "gate_up_proj", infer, ffn_hidden_size=FFN, **common)
    row = nr.Layout([len(infer)], infer, [nr.Shard(1)])
    for name in ROW:
        spec = nr.TensorSpec(name, tuple(SHAPES[name]), DTYPE, layouts[name], row)
        recipe += recipes.Recipe((recipes.Piece(spec, recipes.whole(name), recipes.whole(name)),))
    return recipe


def vllm_params(weights: Dict[str, torch.Tensor], tp: int, i: int) -> Dict[str, torch.Tensor]:
    """What vLLM's weight loaders hold on TP rank i (the byte check's reference)."""
    q, kv, f = HEADS // tp * HEAD_DIM, max(1, KV_HEADS // tp) * HEAD_DIM, FFN // tp
    kv_shard = i // max(1, tp // KV_HEADS)
    return {
        "qkv_proj": torch.cat([weights["q_proj"].narrow(0, i * q, q), weights["k_proj"].narrow(0, kv_shard * kv, kv),
                               weights["v_proj"].narrow(0, kv_shard * kv, kv)]),
        "gate_up_proj": torch.cat([weights["gate_proj"].narrow(0, i * f, f), weights["up_proj"].narrow(0, i * f, f)]),
        "o_proj": weights["o_proj"].narrow(1, i * (HEADS * HEAD_DIM // tp), HEADS * HEAD_DIM // tp).contiguous(),
        "down_proj": weights["down_proj"].narrow(1, i * f, f).contiguous(),
    }


SHAPES = {k: tuple(v.shape) for k, v in initial_weights().items()}


def final_weights(steps: int) -> Dict[str, torch.Tensor]:
    weights = initial_weights()
    for step in range(steps):
        for w in weights.values():
            train_step(w, step)
    return weights


def run_gpus(steps: int) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    train, (dp, tp), infer = groups(world)
    mesh = DeviceMesh("cuda", torch.tensor(train).reshape(dp, tp))
    shards, layouts = trainer_shards(initial_weights(), mesh)
    recipe = plan_recipe(layouts, infer)
    print(f"rank {rank}: NCCL {nr.nccl_library()}", flush=True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0)
    comm = nr.init_comm(world, rank, store, device)
    expected = vllm_params(final_weights(steps), len(infer), infer.index(rank)) if rank in infer else {}
    params = {k: torch.full_like(v, float("nan"), device=device) for k, v in expected.items()}
    with nr.Plan(recipe.specs, rank, nr.Config(mode="auto", ranks_per_node=torch.cuda.device_count())) as plan:
        for step in range(steps):
            if rank in train:
                for local in shards.values():
                    train_step(local, step)
            plan.reshard(recipe.src_views(shards if rank in train else {}, rank),
                         recipe.dst_views(params, rank), comm)
        torch.cuda.synchronize()
        info = plan.info
    bad = [k for k, v in expected.items() if not torch.equal(params[k].cpu(), v)]
    print(f"rank {rank}: {steps} refits, {info.bytes_sent} B sent, {info.bytes_received} B received per step; "
          + (f"MISMATCH in {bad}" if bad else "every byte OK" if expected else "trainer"), flush=True)
    failed = torch.tensor([len(bad)], device=device)
    dist.all_reduce(failed)
    comm.close()
    dist.destroy_process_group()
    return int(failed.item() != 0)


class Cudart:
    """The emulated cudart's few calls the example needs."""

    H2D, D2H = 1, 2

    def __init__(self, lib_dir: str) -> None:
        self.lib = ctypes.CDLL(os.path.join(lib_dir, "libcudart.so.12"))

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned cudaError {code}")

    def set_device(self, device: int) -> None:
        self.check(self.lib.cudaSetDevice(device), "cudaSetDevice")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1))), "cudaMalloc")
        return ptr.value or 0

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self.check(self.lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                            kind, ctypes.c_void_p(stream)), "cudaMemcpyAsync")

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self.check(self.lib.cudaStreamCreate(ctypes.byref(s)), "cudaStreamCreate")
        return s.value or 0

    def sync(self, stream: int) -> None:
        self.check(self.lib.cudaStreamSynchronize(ctypes.c_void_p(stream)), "cudaStreamSynchronize")

    def free(self, ptr: int) -> None:
        self.check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def _fake_rank_shards(rank: int, world: int, train: List[int], dp: int, tp: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return trainer_shards(initial_weights(), DeviceMesh("cpu", torch.tensor(train).reshape(dp, tp)))
    finally:
        dist.destroy_process_group()


def membership(store, rank: int, world: int, step: int, failed: List[int], wait_s: float) -> List[int]:
    """Who is gone after `step`, the same answer on every survivor: each rank reports to the
    store; rank 0 (the coordinator, a trainer) waits up to `wait_s` for the reports and
    publishes the ranks that sent none. This is the application's part (an RL stack's
    controller decides the same way); the library only makes sure nobody waits forever."""
    import json
    import time

    store.set(f"step{step}/alive/{rank}", "1")
    if rank == 0:
        waiting = [r for r in range(world) if r not in failed]
        until = time.monotonic() + wait_s
        while waiting and time.monotonic() < until:
            waiting = [r for r in waiting if not store.check([f"step{step}/alive/{r}"])]
            time.sleep(0.01)
        store.set(f"step{step}/failed", json.dumps(waiting))
    return json.loads(store.get(f"step{step}/failed"))


def run_emulated(lib_dir: str, world: int, steps: int) -> int:
    import threading
    import time

    train, (dp, tp), infer = groups(world)
    if ARGS.kill is not None and ARGS.kill not in infer:
        raise SystemExit(f"--kill {ARGS.kill}: pick an inference rank ({infer})")
    if ARGS.kill is not None and ARGS.kill_step < 1:
        raise SystemExit("--kill-step: step 0 is the warm-up without a deadline; pick 1 or later")
    # DTensor on the CPU (torch's fake backend, one trainer rank at a time) gives each trainer
    # rank its FSDP2 + TP shards and every rank the layouts.
    shards: Dict[int, Dict[str, torch.Tensor]] = {}
    layouts: Dict[str, nr.Layout] = {}
    for r in train:
        shards[r], layouts = _fake_rank_shards(r, world, train, dp, tp)
    recipe = plan_recipe(layouts, infer)
    print(f"NCCL {nr.nccl_library()}", flush=True)
    final = final_weights(steps)
    cuda = Cudart(lib_dir)
    server = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    results: Dict[int, str] = {}
    survivors_done = threading.Event()
    finished = threading.Semaphore(0)

    def rank_main(rank: int) -> None:
        try:
            cuda.set_device(rank)
            store = dist.TCPStore("127.0.0.1", server.port, world, False)
            comm = nr.init_comm(world, rank, store)
            stream = cuda.stream()
            host = dict(shards.get(rank, {}))
            expected = vllm_params(final, len(infer), infer.index(rank)) if rank in infer else {}
            twins = {**host, **{k: torch.zeros_like(v) for k, v in expected.items()}}  # CPU twins
            device = {k: cuda.malloc(t.numel() * t.element_size()) for k, t in twins.items()}
            src_twins = recipe.src_views(host, rank)
            dst_twins = recipe.dst_views({k: twins[k] for k in expected}, rank)

            def pointers(views, names):
                out = []
                for view, piece in zip(views, recipe.pieces):
                    if view is None:
                        out.append(None)
                        continue
                    name = getattr(piece, names).param
                    out.append(device[name] + view.storage_offset() * view.element_size())
                return out

            deadline = ARGS.timeout_ms if ARGS.kill is not None else None
            config = nr.Config(mode="auto", ranks_per_node=4, timeout_ms=deadline)
            plan = nr.Plan(recipe.specs, rank, config)
            plan.check_tensors(src_twins, dst_twins, devices=False)
            src_ptrs, dst_ptrs = pointers(src_twins, "src"), pointers(dst_twins, "dst")
            # Each rank loads the copy kernel on its first call, and on the emulator the ranks
            # get there seconds apart; a deadline counts waiting for peers, so step 0 (a
            # warm-up) runs on a plan without one.
            warm = nr.Plan(recipe.specs, rank, nr.Config(mode="auto", ranks_per_node=4, timeout_ms=0))
            failed: List[int] = []
            recovery = ""
            for step in range(steps):
                current = warm if step == 0 else plan
                if rank == ARGS.kill and step == ARGS.kill_step:
                    # This rank dies: it never calls again. Its process would be gone; here its
                    # thread lingers until the survivors are done, then drops its state.
                    survivors_done.wait()
                    nccl_lib = nr.nccl.cdll()
                    nccl_lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
                    nccl_lib.ncclCommAbort(ctypes.c_void_p(comm.handle))
                    cuda.sync(stream)
                    for ptr in device.values():
                        cuda.free(ptr)
                    results[rank] = f"died before step {step}"
                    return
                for name, t in host.items():
                    train_step(t, step)
                    cuda.copy(device[name], t.data_ptr(), t.numel() * t.element_size(), Cudart.H2D, stream)
                cuda.sync(stream)  # the warm-up's work too: its plan may go
                if current is not warm:
                    warm.close()
                started = time.monotonic()
                current.reshard_pointers(src_ptrs, dst_ptrs, comm, stream)
                if deadline is None or current is warm:
                    continue
                try:
                    nr.comm_wait(comm)  # bounded by the deadline
                except nr.RemoteError as error:
                    print(f"rank {rank}: step {step}: {error.message.splitlines()[0]}", flush=True)
                cuda.sync(stream)  # never blocked: a failed call's work was revoked
                # Every survivor reports by its deadline: wait that long again for the last.
                gone = membership(store, rank, world, step, failed, deadline / 1000 + 1)
                if not gone:
                    continue
                # Recover: the survivors' communicator, the survivors' plan, the step again.
                failed = sorted(failed + gone)
                shrunk = nr.comm_shrink(comm, [config.survivor_of(r) for r in gone])
                comm.close()
                comm = shrunk
                plan.close()
                config = nr.Config(mode="auto", ranks_per_node=4, timeout_ms=deadline, failed_ranks=failed)
                plan = nr.Plan(recipe.specs, config.survivor_of(rank), config)
                plan.reshard_pointers(src_ptrs, dst_ptrs, comm, stream)
                nr.comm_wait(comm)
                cuda.sync(stream)
                recovery = (f"; ranks {gone} gone at step {step}, recovered as rank {plan.rank} of "
                            f"{comm.size} in {time.monotonic() - started:.2f} s")
            cuda.sync(stream)
            info = plan.info
            plan.close()
            warm.close()  # with a single step, still open
            for name, t in expected.items():
                got = twins[name]
                cuda.copy(got.data_ptr(), device[name], got.numel() * got.element_size(), Cudart.D2H, stream)
            cuda.sync(stream)
            bad = [k for k, v in expected.items() if not torch.equal(twins[k], v)]
            for ptr in device.values():
                cuda.free(ptr)
            comm.close()
            state = f"MISMATCH in {bad}" if bad else ("every byte OK" if expected else "trainer")
            results[rank] = (f"{info.bytes_sent} B sent, {info.bytes_received} B received per step; "
                             f"{state}{recovery}")
        except Exception as error:  # reported below; the other ranks may then wait in NCCL
            results[rank] = f"FAILED: {error!r}"
        finally:
            finished.release()

    def release_the_dead() -> None:
        for _ in range(world - (ARGS.kill is not None)):
            finished.acquire()
        survivors_done.set()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    threads.append(threading.Thread(target=release_the_dead))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(world):
        print(f"rank {r}: {steps} refits, {results.get(r, 'no result')}")
    ok = all("FAILED" not in v and "MISMATCH" not in v for v in results.values()) and len(results) == world
    survived = f", rank {ARGS.kill} died and the others recovered" if ARGS.kill is not None else ""
    print(f"refit on {world} emulated GPUs{survived}: {'every byte OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if ARGS.emulated:
        sys.exit(run_emulated(os.path.abspath(ARGS.emulated), ARGS.ranks, ARGS.steps))
    if ARGS.kill is not None:
        sys.exit("--kill runs on the emulator only (--emulated): a real process that dies takes "
                 "its torchrun job with it; docs/resilience.md shows the same steps for GPUs")
    sys.exit(run_gpus(ARGS.steps))
