//! Staging given back after each call (docs/executor.md, "Staging memory").
//!
//! An ordinary call frees its staging into the device's pool, whose release threshold is 0, so
//! the driver takes it back at the device's next synchronization. A captured call's staging is
//! a graph allocation: CUDA keeps the pages of graph memory for the next launch until
//! `cuDeviceGraphMemTrim`, which only the host can call. So a captured call ends with a host
//! function that wakes one library thread, and that thread trims the device's graph memory
//! once the launch no longer holds it. `NCCL_RESHARD_KEEP_STAGING=1` keeps staging instead
//! (no release, no host function): no remapping cost per call, at the price of memory other
//! allocators cannot see.

use super::driver::{self, CurrentContext};
use crate::debug::{self, Level};
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::mpsc::{self, Sender};
use std::sync::OnceLock;
use std::time::Duration;

/// Whether staging is kept for reuse between calls (`NCCL_RESHARD_KEEP_STAGING=1`), read once.
pub(crate) fn keep_staging() -> bool {
    static KEEP: OnceLock<bool> = OnceLock::new();
    *KEEP.get_or_init(|| std::env::var("NCCL_RESHARD_KEEP_STAGING").is_ok_and(|v| v.trim() == "1"))
}

/// How long the trimmer waits, at most, for a launch to let go of its graph memory.
const TRIM_ATTEMPTS: u32 = 200;
const TRIM_PAUSE: Duration = Duration::from_millis(1);

fn trimmer() -> Option<&'static Sender<i32>> {
    static TRIMMER: OnceLock<Option<Sender<i32>>> = OnceLock::new();
    TRIMMER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<i32>();
            std::thread::Builder::new()
                .name("ncclreshard-trim".into())
                .spawn(move || {
                    for ordinal in rx {
                        trim_graph_memory(ordinal);
                    }
                })
                .ok()
                .map(|_| tx)
        })
        .as_ref()
}

/// Enqueues, at the end of a captured call on `stream`, the host function that has the graph
/// memory of device `ordinal` trimmed once the launch is done with it.
pub(crate) fn after_captured_call(stream: sys::CUstream, ordinal: i32) -> Result<()> {
    if trimmer().is_none() {
        // No thread: the graph keeps its memory, as it would with NCCL_RESHARD_KEEP_STAGING.
        return Ok(());
    }
    // SAFETY: `wake` is a plain function that only sends on a channel (no CUDA call, as host
    // functions require); its data is the ordinal, not a pointer.
    driver::call("cuLaunchHostFunc", || unsafe {
        sys::cuLaunchHostFunc(stream, Some(wake), ordinal as usize as *mut c_void)
    })
}

unsafe extern "C" fn wake(data: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        if let Some(tx) = trimmer() {
            let _ = tx.send(data as usize as i32);
        }
    });
}

/// Trims device `ordinal`'s graph memory; the launch that woke us may still be finishing, so
/// this retries until no reserved byte is unused (or gives up after about 0.2 s, leaving the
/// rest to the next trim).
fn trim_graph_memory(ordinal: i32) {
    let trimmed = std::panic::catch_unwind(|| -> Result<bool> {
        let device = super::device::device(ordinal)?;
        let _current: CurrentContext = device.context.push()?;
        let handle = device.context.device;
        for _ in 0..TRIM_ATTEMPTS {
            // SAFETY: a device of this process; trims only memory no graph uses.
            driver::call("cuDeviceGraphMemTrim", || unsafe {
                sys::cuDeviceGraphMemTrim(handle)
            })?;
            let (mut used, mut reserved) = (0u64, 0u64);
            // SAFETY: both attributes are cuuint64_t.
            driver::call("cuDeviceGetGraphMemAttribute", || unsafe {
                sys::cuDeviceGetGraphMemAttribute(
                    handle,
                    sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
                    (&mut used as *mut u64).cast(),
                )
            })?;
            driver::call("cuDeviceGetGraphMemAttribute", || unsafe {
                sys::cuDeviceGetGraphMemAttribute(
                    handle,
                    sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                    (&mut reserved as *mut u64).cast(),
                )
            })?;
            if reserved <= used {
                return Ok(true);
            }
            std::thread::sleep(TRIM_PAUSE);
        }
        Ok(false)
    });
    match trimmed {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => debug::log(Level::Info, || {
            format!("device {ordinal}: graph memory still in use after a captured call; the next trim takes it")
        }),
        Ok(Err(e)) => debug::log(Level::Warn, || {
            format!("device {ordinal}: trimming graph memory after a captured call: {e}")
        }),
        Err(_) => debug::log(Level::Warn, || {
            format!("device {ordinal}: trimming graph memory after a captured call panicked")
        }),
    }
}
