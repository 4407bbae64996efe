//! Shared helpers of the emulator's tests: device setup through the exported driver API, and
//! running a scenario that must abort in a child process (the test binary re-executed with
//! `EMU_TEST_CHILD` naming the scenario).
#![allow(dead_code)]

use cudarc::driver::sys::{CUcontext, CUdeviceptr, CUresult, CUstream};
use ncclreshard_emu::*;
use std::process::{Command, Output};

pub mod nccl;

/// Asserts a driver call succeeded.
pub fn ck(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

/// Initializes the driver and makes device `d`'s primary context current on this thread.
pub fn use_device(d: i32) -> CUcontext {
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        ck(cuInit(0), "cuInit");
        let mut ctx = std::ptr::null_mut();
        ck(cuDevicePrimaryCtxRetain(&mut ctx, d), "retain");
        ck(cuCtxSetCurrent(ctx), "set current");
        ctx
    }
}

pub fn stream(flags: u32) -> CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: writes one handle.
    ck(unsafe { cuStreamCreate(&mut s, flags) }, "cuStreamCreate");
    s
}

pub fn alloc(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: writes one pointer.
    ck(unsafe { cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc");
    p
}

pub fn upload_async(dst: CUdeviceptr, bytes: &[u8], s: CUstream) {
    // SAFETY: `bytes` is readable; the emulator stages pageable sources at the call.
    ck(
        unsafe { cuMemcpyHtoDAsync_v2(dst, bytes.as_ptr().cast(), bytes.len(), s) },
        "HtoDAsync",
    );
}

pub fn download(src: CUdeviceptr, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is writable; synchronous copy on the legacy stream.
    ck(
        unsafe { cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, len) },
        "DtoH",
    );
    out
}

pub fn sync(s: CUstream) {
    // SAFETY: a stream handle from the emulator.
    ck(unsafe { cuStreamSynchronize(s) }, "cuStreamSynchronize");
}

/// The scenario this process must run, when it is a child.
pub fn child() -> Option<String> {
    std::env::var("EMU_TEST_CHILD").ok()
}

/// Runs `test` (a test of this binary) in a child process with `EMU_TEST_CHILD=scenario` and
/// the extra environment, and returns its output.
pub fn run_child(test: &str, scenario: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("test binary path");
    Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("EMU_TEST_CHILD", scenario)
        .envs(env.iter().copied())
        .output()
        .expect("run the test binary")
}

/// Asserts the child aborted (not a normal exit) and its report contains every `needle`.
pub fn assert_aborts(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the child should have aborted; stderr:\n{stderr}"
    );
    for n in needles {
        assert!(
            stderr.contains(n),
            "the report should mention {n:?}; stderr:\n{stderr}"
        );
    }
}
