"""Real multi-process torch.distributed worlds on the CPU for the torch transport's tests:
`run_world` forks one process per rank from the test process (no second torch import, so a
world of 8 starts in well under a second), joins them into a gloo process group and runs a
function on every rank. A rank that raises, hangs past the time limit or dies fails the test
with every rank's report; the processes are killed, never left behind."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


class WorldError(AssertionError):
    """Some rank of a world raised, hung or died; the message has every rank's report."""


def _child(rank: int, world: int, store: str, fn: Callable[..., Any], args: Sequence[Any],
           conn: Any, barrier: bool) -> None:
    try:
        torch.set_num_threads(1)  # 2 cores shared by up to 8 ranks
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
            timeout=timedelta(seconds=60),
        )
        result = ("ok", fn(rank, world, *args))
        if barrier:
            dist.barrier()  # every rank's operations are done before any process goes away
    except BaseException:
        result = ("error", traceback.format_exc())
    try:
        conn.send(result)
        conn.close()
    finally:
        # No interpreter teardown (torch's takes seconds per process on a busy machine);
        # a broken process group is not waited for.
        os._exit(0)


def run_world(
    world: int,
    fn: Callable[..., Any],
    args: Optional[Sequence[Sequence[Any]]] = None,
    timeout: float = 120.0,
    barrier: bool = True,
    dying: Sequence[int] = (),
) -> List[Any]:
    """Runs ``fn(rank, world, *args[rank])`` on every rank of a fresh gloo world of `world`
    processes and returns the results in rank order (return bytes or numpy arrays, not torch
    tensors: torch pickles those as shared memory, gone with the process). Raises WorldError when a rank raises,
    does not report within `timeout` seconds, or dies. With `barrier` the ranks meet after
    `fn` (leave it off when `fn` leaves the group broken). Ranks in `dying` are expected to
    end their process without a report (their result is None)."""
    context = multiprocessing.get_context("fork")
    store = tempfile.mktemp(prefix="ncclreshard-world-")
    pipes, processes = [], []
    try:
        for rank in range(world):
            parent, child = context.Pipe(duplex=False)
            process = context.Process(
                target=_child,
                args=(rank, world, store, fn, args[rank] if args else (), child, barrier),
                daemon=True,
            )
            process.start()
            child.close()
            pipes.append(parent)
            processes.append(process)
        end = time.monotonic() + timeout
        results: List[Any] = [None] * world
        failures = []
        for rank, pipe in enumerate(pipes):
            if not pipe.poll(max(end - time.monotonic(), 0)):
                if rank in dying and not processes[rank].is_alive():
                    continue
                failures.append(f"rank {rank}: no report within {timeout} s")
                continue
            try:
                status, value = pipe.recv()
            except EOFError:
                if rank not in dying:
                    failures.append(f"rank {rank}: died without a report")
                continue
            if status == "ok":
                results[rank] = value
            else:
                failures.append(f"rank {rank} raised:\n{value}")
        if failures:
            raise WorldError("\n".join(failures))
        return results
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        try:
            os.unlink(store)
        except FileNotFoundError:
            pass
