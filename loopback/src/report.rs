//! How the stand-in says what went wrong: NCCL's result codes, texts and last error (shared with
//! the emulator's NCCL, nccl-api/), report lines on stderr prefixed `[ncclreshard-loopback
//! pid:tid]` (so a reader knows the stand-in, not NCCL, speaks), aborts for what NCCL would turn
//! into a hang or corruption, and the panic boundary of every export.

use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

pub use ncclreshard_nccl_api::{
    error_string, fail, last_error, set_last_error, NResult, NcclError, NcclResult, INTERNAL_ERROR,
    INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, SUCCESS, SYSTEM_ERROR, UNHANDLED_CUDA_ERROR,
};

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
            let detail = ncclreshard_nccl_api::panic_message(&*panic);
            fatal(format_args!("stand-in bug: {name} panicked: {detail}"))
        }
    }
}
