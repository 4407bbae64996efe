//! Faults injected on purpose by tests, through the one control the emulator exports beyond
//! CUDA's and NCCL's API: `ncclreshardEmuFailLaunch(device, nth)` makes the `nth` (1-based)
//! `cuLaunchKernel` on `device` from now on fail as a driver refuses a launch (nothing is
//! enqueued, `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`). Tests use it to check that a library call
//! which fails half-way still leaves no peer waiting. A real GPU has no such symbol, so a test
//! finds it with `dlsym` and skips where it is missing.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Mutex, OnceLock};

fn planned() -> &'static Mutex<HashMap<i32, u64>> {
    static PLANNED: OnceLock<Mutex<HashMap<i32, u64>>> = OnceLock::new();
    PLANNED.get_or_init(Default::default)
}

/// Arms a failure of the `nth` launch on `device` from now on (`nth` ≤ 0 disarms it). Returns 0,
/// or -1 for a negative device.
#[no_mangle]
pub extern "C" fn ncclreshardEmuFailLaunch(device: c_int, nth: c_int) -> c_int {
    if device < 0 {
        return -1;
    }
    let mut planned = planned().lock().unwrap_or_else(|e| e.into_inner());
    if nth <= 0 {
        planned.remove(&device);
    } else {
        planned.insert(device, nth as u64);
    }
    0
}

/// Counts a launch on `device`; true when it is the one armed to fail (which disarms it).
pub fn launch_fails(device: i32) -> bool {
    let mut planned = planned().lock().unwrap_or_else(|e| e.into_inner());
    let Some(left) = planned.get_mut(&device) else {
        return false;
    };
    *left -= 1;
    if *left == 0 {
        planned.remove(&device);
        return true;
    }
    false
}
