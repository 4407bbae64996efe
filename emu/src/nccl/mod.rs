//! NCCL, ranks as threads of this process: communicators (`comm`), per-thread groups (`group`),
//! rendezvous point-to-point and collectives on streams (`ops`), reductions (`reduce`), and the
//! C entry points (`api`).

pub mod api;
pub mod comm;
pub mod group;
pub mod ops;
pub mod reduce;

use crate::handles::lock;
use std::sync::Mutex;

/// `ncclResult_t` values.
pub type NcclResult = i32;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;
pub const TIMEOUT: NcclResult = 8;

/// An NCCL call's failure: the result and the text `ncclGetLastError` returns.
#[derive(Debug)]
pub struct NcclError {
    pub result: NcclResult,
    pub message: String,
}

pub type NResult<T> = Result<T, NcclError>;

pub fn fail<T>(result: NcclResult, message: impl Into<String>) -> NResult<T> {
    Err(NcclError {
        result,
        message: message.into(),
    })
}

/// NCCL keeps its last warning in one process-wide buffer; so does the emulator.
static LAST_ERROR: Mutex<[u8; 1024]> = Mutex::new([0; 1024]);

pub fn set_last_error(message: &str) {
    let mut buf = lock(&LAST_ERROR);
    let n = message.len().min(buf.len() - 1);
    buf[..n].copy_from_slice(&message.as_bytes()[..n]);
    buf[n] = 0;
}

/// The buffer's address (static storage, valid for the process's life; its text changes with
/// the next error, as NCCL's does).
pub fn last_error() -> *const std::ffi::c_char {
    lock(&LAST_ERROR).as_ptr().cast()
}

/// `ncclGetErrorString` texts (NCCL's).
pub fn error_string(result: NcclResult) -> &'static std::ffi::CStr {
    match result {
        SUCCESS => c"no error",
        UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        INTERNAL_ERROR => c"internal error - please report this issue to the NCCL developers",
        INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        TIMEOUT => c"timeout",
        _ => c"unknown result code",
    }
}
