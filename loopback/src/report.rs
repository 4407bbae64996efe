//! How the stand-in says what went wrong: NCCL's result codes and texts, the process-wide last
//! error `ncclGetLastError` returns, report lines on stderr prefixed `[ncclreshard-loopback
//! pid:tid]` (so a reader knows the stand-in, not NCCL, speaks), aborts for what NCCL would turn
//! into a hang or corruption, and the panic boundary of every export.

use std::ffi::{c_char, CStr};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

/// `ncclResult_t` values (nccl.h).
pub type NcclResult = i32;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const IN_PROGRESS: NcclResult = 7;

/// An NCCL call's failure: its result and the text `ncclGetLastError` returns.
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

/// A failure that is the caller's misuse (NCCL would return it too): also printed, so it is not
/// lost when the caller only looks at the code.
pub fn misuse<T>(result: NcclResult, message: impl Into<String>) -> NResult<T> {
    let message = message.into();
    report(format_args!("ERROR: {message}"));
    fail(result, message)
}

/// Locks a mutex, ignoring poisoning: a panic is already fatal ([`boundary`]).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Prints one report line (or block) to stderr.
pub fn report(message: impl Display) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    eprintln!(
        "[ncclreshard-loopback {}:{tid}] {message}",
        std::process::id()
    );
}

/// Reports what NCCL would turn into a hang or silent corruption, and aborts.
pub fn fatal(message: impl Display) -> ! {
    report(format_args!("FATAL: {message}"));
    std::process::abort()
}

/// Runs an export's body; a panic (a stand-in bug) is reported and aborts.
pub fn boundary<T>(name: &str, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(panic) => {
            let detail = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            fatal(format_args!("stand-in bug: {name} panicked: {detail}"))
        }
    }
}

/// NCCL keeps its last warning in one process-wide buffer; so does the stand-in.
static LAST_ERROR: Mutex<[u8; 1024]> = Mutex::new([0; 1024]);

pub fn set_last_error(message: &str) {
    let mut buf = lock(&LAST_ERROR);
    let n = message.len().min(buf.len() - 1);
    buf[..n].copy_from_slice(&message.as_bytes()[..n]);
    buf[n] = 0;
}

/// The buffer's address: static storage, valid for the process's life (its text changes with
/// the next error, as NCCL's does).
pub fn last_error() -> *const c_char {
    lock(&LAST_ERROR).as_ptr().cast()
}

/// `ncclGetErrorString` texts (NCCL's).
pub fn error_string(result: NcclResult) -> &'static CStr {
    match result {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        8 => c"timeout",
        _ => c"unknown result code",
    }
}
