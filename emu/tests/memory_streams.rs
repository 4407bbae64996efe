//! Device memory and streams as a CUDA user sees them: bytes round trip, misuse of device memory
//! aborts with a report, stream order, the legacy default stream's rules, per-thread default
//! streams, the pageable-copy hazard, events, stream-ordered allocation, pinned host memory and
//! the runtime API over the same state.

mod common;

use common::*;
use cudarc::driver::sys::{CUmemPool_attribute as Attr, CUresult};
use ncclreshard_emu::*;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A gate a stream waits at (cuLaunchHostFunc), opened by the test.
struct Gate(&'static AtomicBool);

impl Gate {
    fn new() -> Gate {
        Gate(Box::leak(Box::new(AtomicBool::new(false))))
    }
    fn block(&self, s: cudarc::driver::sys::CUstream) {
        unsafe extern "C" fn wait(flag: *mut c_void) {
            // SAFETY: the flag is a leaked AtomicBool.
            let flag = unsafe { &*(flag as *const AtomicBool) };
            while !flag.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // SAFETY: the flag lives forever.
        ck(
            unsafe { cuLaunchHostFunc(s, Some(wait), self.0 as *const _ as *mut c_void) },
            "cuLaunchHostFunc",
        );
    }
    fn open(&self) {
        self.0.store(true, Ordering::Release);
    }
}

fn query(s: cudarc::driver::sys::CUstream) -> CUresult {
    // SAFETY: a stream handle.
    unsafe { cuStreamQuery(s) }
}

/// Polls until the stream is idle or a second has passed.
fn becomes_idle(s: cudarc::driver::sys::CUstream) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        if query(s) == CUresult::CUDA_SUCCESS {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

#[test]
fn bytes_round_trip_through_device_memory() {
    use_device(0);
    let s = stream(1);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    let p = alloc(data.len());
    upload_async(p, &data, s);
    sync(s);
    assert_eq!(download(p, data.len()), data);
    // SAFETY: inside the allocation.
    ck(unsafe { cuMemsetD8Async(p + 10, 0xee, 5, s) }, "memset");
    sync(s);
    let got = download(p, 20);
    assert_eq!(&got[10..15], &[0xee; 5]);
    assert_eq!(got[15], data[15]);
    // Fresh device memory holds garbage, not zeros.
    let q = alloc(64);
    assert!(download(q, 64).iter().all(|&b| b == 0xa5));
    // SAFETY: frees what was allocated.
    unsafe {
        ck(cuMemFree_v2(p), "free");
        ck(cuMemFree_v2(q), "free");
    }
}

#[test]
fn device_pointers_fault_on_the_host() {
    if child().as_deref() == Some("deref") {
        use_device(0);
        let p = alloc(16);
        // SAFETY: none: this must fault, which is what the test checks.
        let v = unsafe { std::ptr::read_volatile(p as *const u8) };
        println!("read {v}");
        return;
    }
    let out = run_child("device_pointers_fault_on_the_host", "deref", &[]);
    assert!(
        !out.status.success(),
        "reading a device pointer on the host must fault"
    );
}

#[test]
fn out_of_bounds_copy_aborts_naming_call_address_and_allocation() {
    if child().as_deref() == Some("oob") {
        use_device(1);
        let p = alloc(100);
        download(p, 101);
        return;
    }
    let out = run_child(
        "out_of_bounds_copy_aborts_naming_call_address_and_allocation",
        "oob",
        &[],
    );
    assert_aborts(
        &out,
        &[
            "cuMemcpyDtoH_v2",
            "out of bounds",
            "nearest allocation",
            "cuMemAlloc_v2 (100 bytes)",
        ],
    );
}

#[test]
fn off_by_one_past_an_allocation_lands_in_no_allocation() {
    if child().as_deref() == Some("gap") {
        use_device(0);
        let p = alloc(256);
        let _q = alloc(256);
        let s = stream(1);
        // SAFETY: deliberately one past the end.
        unsafe { cuMemsetD8Async(p + 256, 0, 1, s) };
        return;
    }
    let out = run_child(
        "off_by_one_past_an_allocation_lands_in_no_allocation",
        "gap",
        &[],
    );
    assert_aborts(
        &out,
        &["cuMemsetD8Async", "no allocation holds this address"],
    );
}

#[test]
fn use_after_free_aborts() {
    if child().as_deref() == Some("uaf") {
        use_device(0);
        let p = alloc(64);
        // SAFETY: frees, then uses: the misuse under test.
        unsafe {
            ck(cuMemFree_v2(p), "free");
            cuMemsetD8_v2(p, 1, 8);
        }
        return;
    }
    let out = run_child("use_after_free_aborts", "uaf", &[]);
    assert_aborts(&out, &["cuMemsetD8_v2", "freed by cuMemFree_v2"]);
}

#[test]
fn return_mode_turns_misuse_into_error_codes() {
    if child().as_deref() == Some("return") {
        use_device(0);
        let p = alloc(64);
        let mut buf = [0u8; 128];
        // SAFETY: out-of-bounds and double-free calls whose errors are under test.
        unsafe {
            assert_eq!(
                cuMemcpyDtoH_v2(buf.as_mut_ptr().cast(), p, 128),
                CUresult::CUDA_ERROR_INVALID_VALUE
            );
            ck(cuMemFree_v2(p), "free");
            assert_eq!(cuMemFree_v2(p), CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        println!("child done");
        return;
    }
    let out = run_child(
        "return_mode_turns_misuse_into_error_codes",
        "return",
        &[("NCCL_RESHARD_EMU_ON_ERROR", "return")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("double free"), "{stderr}");
}

#[test]
fn allocations_beyond_device_memory_fail() {
    if child().as_deref() == Some("oom") {
        use_device(0);
        let mut p = 0;
        // SAFETY: writes one pointer.
        unsafe {
            assert_eq!(
                cuMemAlloc_v2(&mut p, 2 << 20),
                CUresult::CUDA_ERROR_OUT_OF_MEMORY
            );
            ck(cuMemAlloc_v2(&mut p, 600 << 10), "first");
            assert_eq!(
                cuMemAlloc_v2(&mut p, 600 << 10),
                CUresult::CUDA_ERROR_OUT_OF_MEMORY
            );
            let (mut free, mut total) = (0, 0);
            ck(cuMemGetInfo_v2(&mut free, &mut total), "info");
            assert_eq!((free, total), ((1 << 20) - (600 << 10), 1 << 20));
        }
        return;
    }
    let out = run_child(
        "allocations_beyond_device_memory_fail",
        "oom",
        &[("NCCL_RESHARD_EMU_MEMORY_BYTES", "1048576")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn releasing_the_primary_context_reports_leaks() {
    if child().as_deref() == Some("leak") {
        use_device(2);
        alloc(4096);
        // SAFETY: balances use_device's retain.
        ck(unsafe { cuDevicePrimaryCtxRelease_v2(2) }, "release");
        return;
    }
    let out = run_child("releasing_the_primary_context_reports_leaks", "leak", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("leak") && stderr.contains("cuMemAlloc_v2 (4096 bytes)"),
        "{stderr}"
    );
}

#[test]
fn stream_work_runs_in_order_after_the_call_returns() {
    use_device(0);
    let s = stream(1);
    let p = alloc(4);
    let gate = Gate::new();
    gate.block(s);
    // SAFETY: inside the allocation.
    unsafe {
        ck(cuMemsetD8Async(p, 1, 4, s), "memset 1");
        ck(cuMemsetD8Async(p, 2, 2, s), "memset 2");
    }
    assert_eq!(query(s), CUresult::CUDA_ERROR_NOT_READY);
    gate.open();
    sync(s);
    assert_eq!(download(p, 4), [2, 2, 1, 1]);
}

#[test]
fn legacy_stream_waits_for_blocking_streams_only() {
    use_device(3);
    let legacy = std::ptr::null_mut();
    let blocking = stream(0);
    let gate = Gate::new();
    gate.block(blocking);
    let p = alloc(8);
    // SAFETY: inside the allocation (queued on the legacy stream, returns at once).
    ck(unsafe { cuMemsetD8_v2(p, 7, 8) }, "memset on legacy");
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        query(legacy),
        CUresult::CUDA_ERROR_NOT_READY,
        "legacy work must wait for the blocking stream"
    );
    gate.open();
    assert!(becomes_idle(legacy));

    let nonblocking = stream(1);
    let gate = Gate::new();
    gate.block(nonblocking);
    // SAFETY: as above.
    ck(unsafe { cuMemsetD8_v2(p, 8, 8) }, "memset on legacy");
    assert!(
        becomes_idle(legacy),
        "legacy work must not wait for a non-blocking stream"
    );
    gate.open();

    // Later work on a blocking stream waits for the legacy stream.
    let gate = Gate::new();
    gate.block(legacy);
    // SAFETY: as above.
    ck(
        unsafe { cuMemsetD8Async(p, 9, 8, blocking) },
        "memset on blocking",
    );
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(query(blocking), CUresult::CUDA_ERROR_NOT_READY);
    gate.open();
    sync(blocking);
    assert_eq!(download(p, 8), [9; 8]);
}

#[test]
fn per_thread_default_streams_differ_by_thread() {
    let per_thread = 2usize as cudarc::driver::sys::CUstream;
    let ctx = use_device(4) as usize;
    let gate = Gate::new();
    gate.block(per_thread);
    let other = std::thread::spawn(move || {
        // SAFETY: the same primary context, current on this thread too.
        ck(unsafe { cuCtxSetCurrent(ctx as _) }, "set current");
        query(2usize as cudarc::driver::sys::CUstream)
    })
    .join()
    .unwrap();
    assert_eq!(
        other,
        CUresult::CUDA_SUCCESS,
        "another thread's per-thread stream is idle"
    );
    assert_eq!(query(per_thread), CUresult::CUDA_ERROR_NOT_READY);
    gate.open();
    sync(per_thread);
}

#[test]
fn synchronous_pageable_copy_races_with_a_non_blocking_stream() {
    if child().as_deref() == Some("pageable") {
        use_device(5);
        let s = stream(1);
        let src = alloc(1024);
        let dst = alloc(1024);
        let host = vec![3u8; 1024];
        // SAFETY: a synchronous copy from pageable memory, then unordered use: the hazard.
        unsafe {
            ck(cuMemcpyHtoD_v2(src, host.as_ptr().cast(), 1024), "HtoD");
            ck(cuMemcpyDtoDAsync_v2(dst, src, 1024, s), "DtoDAsync");
        }
        sync(s);
        return;
    }
    let out = run_child(
        "synchronous_pageable_copy_races_with_a_non_blocking_stream",
        "pageable",
        &[],
    );
    assert_aborts(
        &out,
        &[
            "has not finished writing",
            "cuMemcpyDtoDAsync_v2",
            "non-blocking",
        ],
    );
}

#[test]
fn synchronous_pageable_copy_is_ordered_before_blocking_streams() {
    use_device(5);
    let s = stream(0);
    let src = alloc(1024);
    let dst = alloc(1024);
    let host = vec![4u8; 1024];
    // SAFETY: as in the test above, on a blocking stream (ordered after the copy).
    unsafe {
        ck(cuMemcpyHtoD_v2(src, host.as_ptr().cast(), 1024), "HtoD");
        ck(cuMemcpyDtoDAsync_v2(dst, src, 1024, s), "DtoDAsync");
    }
    sync(s);
    assert_eq!(download(dst, 1024), host);
}

#[test]
fn events_order_streams_and_measure_time() {
    use_device(6);
    let a = stream(1);
    let b = stream(1);
    let p = alloc(4);
    let (mut start, mut end) = (std::ptr::null_mut(), std::ptr::null_mut());
    let gate = Gate::new();
    // SAFETY: events and streams of the current context.
    unsafe {
        ck(cuEventCreate(&mut start, 0), "event");
        ck(cuEventCreate(&mut end, 0), "event");
        ck(cuEventRecord(start, a), "record");
        gate.block(a);
        ck(cuMemsetD8Async(p, 1, 4, a), "memset a");
        ck(cuEventRecord(end, a), "record");
        ck(cuStreamWaitEvent(b, end, 0), "wait");
        ck(cuMemsetD8Async(p, 2, 4, b), "memset b");
        assert_eq!(cuEventQuery(end), CUresult::CUDA_ERROR_NOT_READY);
        std::thread::sleep(Duration::from_millis(20));
        gate.open();
        ck(cuEventSynchronize(end), "sync");
        sync(b);
        let mut ms = 0f32;
        ck(cuEventElapsedTime(&mut ms, start, end), "elapsed");
        assert!(ms >= 15.0, "{ms} ms");
    }
    assert_eq!(download(p, 4), [2; 4]);
}

#[test]
fn stream_ordered_allocation_lives_between_alloc_and_free() {
    use_device(7);
    let s = stream(1);
    let mut pool = std::ptr::null_mut();
    let mut p = 0;
    let mut pinned = std::ptr::null_mut();
    // SAFETY: driver calls with valid out-pointers; memory used inside its window.
    unsafe {
        ck(cuDeviceGetDefaultMemPool(&mut pool, 7), "pool");
        let mut threshold = u64::MAX;
        ck(
            cuMemPoolSetAttribute(
                pool,
                Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as u32,
                (&mut threshold as *mut u64).cast(),
            ),
            "threshold",
        );
        ck(cuMemHostAlloc(&mut pinned, 1000, 0), "pinned");
        ck(cuMemAllocAsync(&mut p, 1000, s), "alloc async");
        ck(cuMemsetD8Async(p, 5, 1000, s), "memset");
        ck(cuMemcpyDtoHAsync_v2(pinned, p, 1000, s), "DtoH to pinned");
        ck(cuMemFreeAsync(p, s), "free async");
        sync(s);
        assert!(std::slice::from_raw_parts(pinned as *const u8, 1000)
            .iter()
            .all(|&b| b == 5));
        let get = |a: Attr| {
            let mut v = 0u64;
            ck(
                cuMemPoolGetAttribute(pool, a as u32, (&mut v as *mut u64).cast()),
                "attr",
            );
            v
        };
        assert_eq!(get(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0);
        assert_eq!(get(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH), 1000);
        assert_eq!(get(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 1000);
        ck(cuMemPoolTrimTo(pool, 0), "trim");
        assert_eq!(get(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 0);
        ck(cuMemFreeHost(pinned), "free pinned");
    }
}

#[test]
fn use_before_stream_ordered_alloc_aborts() {
    if child().as_deref() == Some("early") {
        use_device(7);
        let a = stream(1);
        let b = stream(1);
        let gate = Gate::new();
        gate.block(a);
        let mut p = 0;
        // SAFETY: the allocation is used on another, unordered stream: the misuse under test.
        unsafe {
            ck(cuMemAllocAsync(&mut p, 256, a), "alloc async");
            ck(cuMemsetD8Async(p, 0, 256, b), "memset");
        }
        sync(b);
        return;
    }
    let out = run_child("use_before_stream_ordered_alloc_aborts", "early", &[]);
    assert_aborts(
        &out,
        &["not yet allocated", "cuMemAllocAsync", "cuMemsetD8Async"],
    );
}

#[test]
fn use_after_stream_ordered_free_aborts() {
    if child().as_deref() == Some("late") {
        use_device(7);
        let a = stream(1);
        let mut p = 0;
        // SAFETY: use after the free took effect: the misuse under test.
        unsafe {
            ck(cuMemAllocAsync(&mut p, 256, a), "alloc async");
            ck(cuMemFreeAsync(p, a), "free async");
            ck(cuMemsetD8Async(p, 0, 256, a), "memset");
        }
        sync(a);
        return;
    }
    let out = run_child("use_after_stream_ordered_free_aborts", "late", &[]);
    assert_aborts(&out, &["use after free", "cuMemFreeAsync"]);
}

#[test]
fn pointer_attributes_know_device_pinned_and_host_memory() {
    use_device(2);
    let p = alloc(300);
    let mut ordinal = -1i32;
    let mut start = 0u64;
    let mut size = 0usize;
    let host = [0u8; 8];
    // SAFETY: each call writes one value of the attribute's type.
    unsafe {
        ck(
            cuPointerGetAttribute((&mut ordinal as *mut i32).cast(), 9, p + 10),
            "ordinal",
        );
        ck(
            cuPointerGetAttribute((&mut start as *mut u64).cast(), 11, p + 10),
            "start",
        );
        ck(
            cuPointerGetAttribute((&mut size as *mut usize).cast(), 12, p + 10),
            "size",
        );
        assert_eq!(
            cuPointerGetAttribute((&mut ordinal as *mut i32).cast(), 9, host.as_ptr() as u64),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "pageable host memory is unknown to the driver"
        );
    }
    assert_eq!((ordinal, start, size), (2, p, 300));
}

#[test]
fn the_runtime_shares_the_driver_state() {
    // SAFETY: runtime calls with valid out-pointers.
    unsafe {
        let mut n = 0;
        assert_eq!(cudaGetDeviceCount(&mut n), 0);
        assert_eq!(n, 8);
        assert_eq!(cudaSetDevice(3), 0);
        let mut d = -1;
        assert_eq!(cudaGetDevice(&mut d), 0);
        assert_eq!(d, 3);
        let mut p = std::ptr::null_mut();
        assert_eq!(cudaMalloc(&mut p, 64), 0);
        let mut attrs = CudaPointerAttributes {
            memory_type: 0,
            device: 0,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
        };
        assert_eq!(cudaPointerGetAttributes(&mut attrs, p), 0);
        assert_eq!((attrs.memory_type, attrs.device), (2, 3));
        let host: Vec<u8> = (0..64).collect();
        let mut back = vec![0u8; 64];
        // cudaMemcpyDefault (4) infers both directions.
        assert_eq!(cudaMemcpy(p, host.as_ptr().cast(), 64, 4), 0);
        assert_eq!(cudaMemcpy(back.as_mut_ptr().cast(), p, 64, 4), 0);
        assert_eq!(back, host);
        // The driver sees the runtime's context as current.
        let mut dev = -1;
        ck(cuCtxGetDevice(&mut dev), "cuCtxGetDevice");
        assert_eq!(dev, 3);
        assert_eq!(cudaSetDevice(99), 101);
        assert_eq!(cudaGetLastError(), 101);
        assert_eq!(cudaGetLastError(), 0);
        assert_eq!(
            CStr::from_ptr(cudaGetErrorString(101)).to_str().unwrap(),
            "invalid device ordinal"
        );
        assert_eq!(
            CStr::from_ptr(cudaGetErrorName(2)).to_str().unwrap(),
            "cudaErrorMemoryAllocation"
        );
        assert_eq!(cudaFree(p), 0);
    }
}

#[test]
fn created_contexts_own_their_streams_and_calls_need_a_context() {
    use_device(1);
    let none = std::thread::spawn(|| {
        let mut p = 0;
        // SAFETY: no context is current on this new thread.
        unsafe { cuMemAlloc_v2(&mut p, 16) }
    })
    .join()
    .unwrap();
    assert_eq!(none, CUresult::CUDA_ERROR_INVALID_CONTEXT);
    // SAFETY: context and stream handles from the emulator.
    unsafe {
        let (mut primary, mut ctx, mut owner) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        ck(cuCtxGetCurrent(&mut primary), "current");
        ck(cuCtxCreate_v2(&mut ctx, 0, 1), "create");
        assert_ne!(ctx, primary);
        let s = stream(1);
        ck(cuStreamGetCtx(s, &mut owner), "stream context");
        assert_eq!(owner, ctx);
        ck(
            cuStreamGetCtx(std::ptr::null_mut(), &mut owner),
            "legacy stream context",
        );
        assert_eq!(owner, ctx, "the NULL stream is the current context's");
        ck(cuCtxDestroy_v2(ctx), "destroy");
        assert_eq!(
            query(s),
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            "its streams went with it"
        );
        ck(cuCtxGetCurrent(&mut owner), "current");
        assert_eq!(owner, primary);
    }
}
