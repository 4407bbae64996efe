//! Reports and the C boundary: how the emulator tells a user what went wrong.
//!
//! A misuse is *strict*: by default the report is printed and the process aborts (tests of code
//! that must abort run it in a child process); with `NCCL_RESHARD_EMU_ON_ERROR=return` the
//! report is printed and the API returns an error code. No panic crosses the C boundary: every
//! export runs inside [`boundary`], and a panic (an emulator bug) is reported and aborts.

use crate::config::{config, OnError};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Prints one report line (or block) to stderr, prefixed so it stands out in test output.
pub fn report(message: impl Display) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    eprintln!("[ncclreshard-emu {}:{tid}] {message}", std::process::id());
}

/// Reports a fatal misuse and aborts the process.
pub fn fatal(message: impl Display) -> ! {
    report(format_args!("FATAL: {message}"));
    std::process::abort()
}

/// A caught misuse: aborts, or (`NCCL_RESHARD_EMU_ON_ERROR=return`) reports it and returns
/// `error` for the caller to hand back.
pub fn strict<E>(message: impl Display, error: E) -> E {
    match config().on_error {
        OnError::Abort => fatal(message),
        OnError::Return => {
            report(format_args!("ERROR: {message}"));
            error
        }
    }
}

/// Runs an export's body, turning a panic into a report and an abort.
pub fn boundary<T>(name: &str, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(panic) => {
            let detail = ncclreshard_nccl_api::panic_message(&*panic);
            fatal(format_args!("emulator bug: {name} panicked: {detail}"))
        }
    }
}
