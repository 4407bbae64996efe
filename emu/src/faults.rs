//! Faults injected on purpose by tests, through the controls the emulator exports beyond CUDA's
//! and NCCL's API. A real GPU has no such symbols, so a test finds them with `dlsym` and skips
//! where they are missing.
//!
//! - `ncclreshardEmuFailLaunchOnStream(stream, nth)` makes the `nth` (1-based) `cuLaunchKernel`
//!   on `stream` from now on fail as a driver refuses a launch (nothing is enqueued,
//!   `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`): a library call which fails half-way must still leave
//!   no peer waiting. By stream, not device, so that it hits one rank also where ranks share a
//!   device (the loopback NCCL stand-in).
//! - `ncclreshardEmuStopRank(comm, after)`: the rank dies after `after` more operations (its
//!   later ones never run), before a call (0) or in the middle of a round's group.
//! - `ncclreshardEmuDelayRank(comm, ms)`: the rank is slow but alive.
//! - `ncclreshardEmuBreakLink(comm, peer)`: a network error between two ranks.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Mutex, OnceLock};

/// Launches left before the failure, by stream (the resolved stream's handle).
fn planned() -> &'static Mutex<HashMap<usize, u64>> {
    static PLANNED: OnceLock<Mutex<HashMap<usize, u64>>> = OnceLock::new();
    PLANNED.get_or_init(Default::default)
}

/// Arms a failure of the `nth` launch of the copy and conversion kernels on `stream` from now on
/// (`nth` ≤ 0 disarms it; the loopback stand-in's copies do not count); the
/// calling thread's current context resolves NULL and the per-thread handle. Returns 0, or -1
/// for a stream the emulator does not know.
#[no_mangle]
pub extern "C" fn ncclreshardEmuFailLaunchOnStream(
    stream: *mut std::ffi::c_void,
    nth: c_int,
) -> c_int {
    let Ok(s) = crate::stream::resolve(stream as usize) else {
        return -1;
    };
    let mut planned = planned().lock().unwrap_or_else(|e| e.into_inner());
    if nth <= 0 {
        planned.remove(&s.handle);
    } else {
        planned.insert(s.handle, nth as u64);
    }
    0
}

/// Counts a launch on the stream with handle `stream`; true when it is the one armed to fail
/// (which disarms it).
pub fn launch_fails(stream: usize) -> bool {
    let mut planned = planned().lock().unwrap_or_else(|e| e.into_inner());
    let Some(left) = planned.get_mut(&stream) else {
        return false;
    };
    *left -= 1;
    if *left == 0 {
        planned.remove(&stream);
        return true;
    }
    false
}

/// Applies `change` to the injected faults of communicator `comm`; -1 for an unknown one.
fn with_comm(comm: *mut std::ffi::c_void, change: impl FnOnce(&crate::nccl::comm::Comm)) -> c_int {
    match crate::nccl::comm::get(comm as usize) {
        Ok(c) => {
            change(&c);
            crate::completion::progress();
            0
        }
        Err(_) => -1,
    }
}

/// Stops the rank of `comm` as a process that dies would: of the operations issued on it from
/// now on, the first `after` still run and the rest never become active (its peers wait for
/// them). `after` < 0 lets every operation run again. Returns 0, or -1 for an unknown `comm`.
#[no_mangle]
pub extern "C" fn ncclreshardEmuStopRank(comm: *mut std::ffi::c_void, after: c_int) -> c_int {
    with_comm(comm, |c| {
        let issued = c.issued.load(std::sync::atomic::Ordering::Relaxed);
        lock_faults(c).stop_after = u64::try_from(after).ok().map(|n| issued + n);
    })
}

/// Slows the rank of `comm`: each group of its operations becomes active `ms` milliseconds
/// after its stream reaches it (0: no delay). Returns 0, or -1 for an unknown `comm`.
#[no_mangle]
pub extern "C" fn ncclreshardEmuDelayRank(comm: *mut std::ffi::c_void, ms: c_int) -> c_int {
    with_comm(comm, |c| {
        lock_faults(c).delay = std::time::Duration::from_millis(ms.max(0) as u64);
    })
}

/// Breaks the link between the rank of `comm` and `peer` (either side may break it): their
/// transfers never complete and set both communicators' asynchronous error to ncclRemoteError,
/// as a network error does. Returns 0, or -1 for an unknown `comm`.
#[no_mangle]
pub extern "C" fn ncclreshardEmuBreakLink(comm: *mut std::ffi::c_void, peer: c_int) -> c_int {
    with_comm(comm, |c| {
        lock_faults(c).broken.insert(peer);
    })
}

fn lock_faults(
    c: &crate::nccl::comm::Comm,
) -> std::sync::MutexGuard<'_, crate::nccl::comm::CommFaults> {
    crate::handles::lock(&c.faults)
}
