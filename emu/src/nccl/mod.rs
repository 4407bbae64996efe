//! NCCL, ranks as threads of this process: communicators (`comm`), per-thread groups (`group`),
//! rendezvous point-to-point and collectives on streams (`ops`), reductions (`reduce`), and the
//! C entry points (`api`).

pub mod api;
pub mod comm;
pub mod group;
pub mod ops;
pub mod reduce;

pub use ncclreshard_nccl_api::{
    error_string, fail, last_error, set_last_error, NResult, NcclError, NcclResult, INTERNAL_ERROR,
    INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, REMOTE_ERROR, SUCCESS, SYSTEM_ERROR, TIMEOUT,
    UNHANDLED_CUDA_ERROR,
};
