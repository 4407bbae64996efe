"""ncclreshard: reshard tensors sharded in one PyTorch DTensor layout over some GPUs into
another layout over other GPUs, peer to peer over NCCL (libncclreshard's C ABI via ctypes).

    import ncclreshard as nr
    spec = nr.TensorSpec("o_proj.weight", (4096, 4096), torch.bfloat16,
                         src=nr.Layout.from_dtensor(param), dst=nr.Layout([2], 4, [nr.Shard(1)]))
    with nr.Plan([spec], rank) as plan:          # once; no communication
        plan.reshard([param.to_local()], [None], comm)   # every step, on the current stream

With a deadline (``Config(timeout_ms=...)``) a dead or stalled peer makes the call fail instead
of hang: ``comm_wait`` raises ``RemoteError``; the survivors ``comm_shrink`` the communicator,
plan with ``Config(failed_ranks=...)`` and call again (docs/resilience.md).
"""

from ._lib import InvalidArgumentError, NcclReshardError, RemoteError, library_path
from .comm import (
    Communicator,
    comm_from_pynccl,
    comm_from_process_group,
    comm_get_unique_id,
    comm_grow,
    comm_revoke,
    comm_shrink,
    comm_status,
    comm_wait,
    init_comm,
)
from .layout import Layout, local_runs, local_shape
from .nccl import NcclLibrary, nccl_library
from .placements import Placement, Replicate, Shard, ShardBlocks, StridedShard
from .plan import Plan, PlanCache, PlanInfo, ScaleView, Transfer
from .spec import Case, Config, Quant, TensorSpec
from .torch_transport import TorchTransport
from .nemo_rl import xferdtensor

try:
    from ._version import __version__
except ImportError:  # a source tree setup.py has not built
    __version__ = "0+unknown"

__all__ = [
    "Case",
    "Communicator",
    "Config",
    "InvalidArgumentError",
    "Layout",
    "NcclLibrary",
    "NcclReshardError",
    "Placement",
    "Plan",
    "PlanCache",
    "PlanInfo",
    "Quant",
    "RemoteError",
    "Replicate",
    "ScaleView",
    "Shard",
    "ShardBlocks",
    "StridedShard",
    "TensorSpec",
    "TorchTransport",
    "xferdtensor",
    "Transfer",
    "comm_from_process_group",
    "comm_from_pynccl",
    "comm_get_unique_id",
    "comm_grow",
    "comm_revoke",
    "comm_shrink",
    "comm_status",
    "comm_wait",
    "init_comm",
    "library_path",
    "local_runs",
    "local_shape",
    "nccl_library",
]
