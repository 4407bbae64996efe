//! Stream capture and graphs as CUDA defines them: captured work runs only at launch, each launch
//! replays it; calls that are illegal during a capture fail with CUDA's codes and invalidate it;
//! cross-stream captures join and must be joined back; graph allocations live within a launch.

mod common;

use common::*;
use cudarc::driver::sys::{CUgraph, CUresult, CUstream};
use ncclreshard_emu::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A global-mode capture forbids unsafe calls on every thread of the process, so this file's
/// tests run one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const GLOBAL: u32 = 0;
const THREAD_LOCAL: u32 = 1;
const RELAXED: u32 = 2;

fn begin(s: CUstream, mode: u32) {
    // SAFETY: a stream handle.
    ck(unsafe { cuStreamBeginCapture_v2(s, mode) }, "begin capture");
}

fn end(s: CUstream) -> (CUresult, CUgraph) {
    let mut g = std::ptr::null_mut();
    // SAFETY: writes one handle.
    let r = unsafe { cuStreamEndCapture(s, &mut g) };
    (r, g)
}

fn try_alloc() -> CUresult {
    let mut p = 0;
    // SAFETY: writes one pointer.
    unsafe { cuMemAlloc_v2(&mut p, 64) }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count(_: *mut c_void) {
    COUNTER.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn captured_work_runs_only_when_launched_and_replays_each_time() {
    let _serial = serial();
    use_device(0);
    let s = stream(1);
    let p = alloc(64);
    let q = alloc(64);
    let host: Vec<u8> = (0..64).collect();
    begin(s, GLOBAL);
    upload_async(p, &host, s);
    // SAFETY: device memory of this context; the host function counts launches.
    unsafe {
        ck(cuMemcpyDtoDAsync_v2(q, p, 64, s), "copy");
        ck(cuMemsetD8Async(q, 0xff, 4, s), "memset");
        ck(
            cuLaunchHostFunc(s, Some(count), std::ptr::null_mut()),
            "host func",
        );
    }
    let (r, g) = end(s);
    ck(r, "end capture");
    assert_eq!(COUNTER.load(Ordering::SeqCst), 0, "nothing runs at capture");
    let mut n = 0;
    let mut exec = std::ptr::null_mut();
    // SAFETY: graph handles from the capture above.
    unsafe {
        ck(cuGraphGetNodes(g, std::ptr::null_mut(), &mut n), "nodes");
        assert_eq!(n, 4);
        ck(cuGraphInstantiateWithFlags(&mut exec, g, 0), "instantiate");
        for _ in 0..3 {
            ck(cuMemsetD8Async(q, 0, 64, s), "reset");
            ck(cuGraphLaunch(exec, s), "launch");
            sync(s);
            let got = download(q, 64);
            assert_eq!(&got[..4], &[0xff; 4]);
            assert_eq!(&got[4..], &host[4..]);
        }
        assert_eq!(COUNTER.load(Ordering::SeqCst), 3);
        ck(cuGraphExecDestroy(exec), "destroy exec");
        ck(cuGraphDestroy(g), "destroy graph");
    }
}

#[test]
fn unsafe_calls_from_the_capturing_thread_fail_and_invalidate() {
    let _serial = serial();
    use_device(1);
    let s = stream(1);
    begin(s, GLOBAL);
    assert_eq!(try_alloc(), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    // Work recorded after the invalidation is refused too.
    let p = 0;
    // SAFETY: never runs: the capture is invalid.
    assert_eq!(
        unsafe { cuMemsetD8Async(p, 0, 0, s) },
        CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    );
    let (r, g) = end(s);
    assert_eq!(r, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    assert!(g.is_null());
    // The stream is usable again.
    assert_eq!(try_alloc(), CUresult::CUDA_SUCCESS);
}

#[test]
fn stream_synchronization_during_capture_fails_and_invalidates() {
    let _serial = serial();
    use_device(1);
    let s = stream(1);
    begin(s, RELAXED);
    // SAFETY: a capturing stream: the call under test.
    assert_eq!(
        unsafe { cuStreamSynchronize(s) },
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    begin(s, GLOBAL);
    // SAFETY: as above.
    assert_eq!(
        unsafe { cuStreamQuery(s) },
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    begin(s, GLOBAL);
    // SAFETY: as above.
    assert_eq!(
        unsafe { cuCtxSynchronize() },
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn global_capture_forbids_unsafe_calls_on_other_threads_unless_relaxed() {
    let _serial = serial();
    // One process-wide scenario: global-mode captures affect every thread of the process.
    if child().as_deref() != Some("global") {
        let out = run_child(
            "global_capture_forbids_unsafe_calls_on_other_threads_unless_relaxed",
            "global",
            &[],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let ctx = use_device(2) as usize;
    let s = stream(1);
    let other = move |mode: Option<u32>| {
        std::thread::spawn(move || {
            // SAFETY: the same context, made current on this thread.
            unsafe {
                ck(cuCtxSetCurrent(ctx as _), "set current");
                if let Some(mut m) = mode {
                    ck(cuThreadExchangeStreamCaptureMode(&mut m), "exchange");
                    assert_eq!(m, GLOBAL, "threads start in global mode");
                }
            }
            try_alloc()
        })
        .join()
        .unwrap()
    };
    begin(s, GLOBAL);
    assert_eq!(other(None), CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    begin(s, GLOBAL);
    assert_eq!(other(Some(RELAXED)), CUresult::CUDA_SUCCESS);
    assert_eq!(other(Some(THREAD_LOCAL)), CUresult::CUDA_SUCCESS);
    ck(end(s).0, "end capture");
    begin(s, THREAD_LOCAL);
    assert_eq!(
        other(None),
        CUresult::CUDA_SUCCESS,
        "thread-local captures ignore other threads"
    );
    assert_eq!(try_alloc(), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn the_legacy_stream_cannot_be_captured_or_depend_on_a_capture() {
    let _serial = serial();
    use_device(3);
    // SAFETY: the legacy stream handle.
    assert_eq!(
        unsafe { cuStreamBeginCapture_v2(std::ptr::null_mut(), GLOBAL) },
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    let s = stream(0);
    let p = alloc(16);
    begin(s, RELAXED);
    // SAFETY: legacy-stream work while a blocking stream is captured: the call under test.
    assert_eq!(
        unsafe { cuMemsetD8Async(p, 0, 16, std::ptr::null_mut()) },
        CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    );
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn forked_streams_join_the_capture_and_must_rejoin() {
    let _serial = serial();
    use_device(4);
    let (s, t) = (stream(1), stream(1));
    let p = alloc(8);
    let (mut fork, mut join) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: events and streams of this context.
    unsafe {
        ck(cuEventCreate(&mut fork, 0), "event");
        ck(cuEventCreate(&mut join, 0), "event");
        begin(s, GLOBAL);
        ck(cuEventRecord(fork, s), "record fork");
        ck(cuStreamWaitEvent(t, fork, 0), "t joins");
        let mut status = 0u32;
        ck(cuStreamIsCapturing(t, &mut status), "is capturing");
        assert_eq!(status, 1, "t is part of the capture");
        assert_eq!(cuEventQuery(fork), CUresult::CUDA_ERROR_CAPTURED_EVENT);
        assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

        begin(s, GLOBAL);
        ck(cuEventRecord(fork, s), "record fork");
        ck(cuStreamWaitEvent(t, fork, 0), "t joins");
        ck(cuMemsetD8Async(p, 3, 8, t), "memset on t");
        assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED);

        begin(s, GLOBAL);
        ck(cuEventRecord(fork, s), "record fork");
        ck(cuStreamWaitEvent(t, fork, 0), "t joins");
        ck(cuMemsetD8Async(p, 4, 8, t), "memset on t");
        ck(cuEventRecord(join, t), "record join");
        ck(cuStreamWaitEvent(s, join, 0), "s joins t back");
        let (r, g) = end(s);
        ck(r, "end capture");
        let mut exec = std::ptr::null_mut();
        ck(cuGraphInstantiateWithFlags(&mut exec, g, 0), "instantiate");
        ck(cuGraphLaunch(exec, s), "launch");
        sync(s);
        assert_eq!(download(p, 8), [4; 8]);
        ck(cuStreamIsCapturing(t, &mut status), "is capturing");
        assert_eq!(status, 0, "the capture ended for t too");
    }
}

#[test]
fn waiting_on_uncaptured_work_breaks_capture_isolation() {
    let _serial = serial();
    use_device(5);
    let (s, t) = (stream(1), stream(1));
    let mut e = std::ptr::null_mut();
    // SAFETY: an event recorded outside the capture, waited on inside it.
    unsafe {
        ck(cuEventCreate(&mut e, 0), "event");
        ck(cuEventRecord(e, t), "record");
        begin(s, GLOBAL);
        assert_eq!(
            cuStreamWaitEvent(s, e, 0),
            CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
        );
    }
    assert_eq!(end(s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn graph_allocations_are_live_only_between_their_nodes() {
    let _serial = serial();
    use_device(6);
    let s = stream(1);
    let out = alloc(32);
    let mut p = 0;
    begin(s, GLOBAL);
    // SAFETY: stream-ordered allocation inside the capture, used between its nodes.
    unsafe {
        ck(cuMemAllocAsync(&mut p, 32, s), "alloc node");
        ck(cuMemsetD8Async(p, 9, 32, s), "memset");
        ck(cuMemcpyDtoDAsync_v2(out, p, 32, s), "copy");
        ck(cuMemFreeAsync(p, s), "free node");
    }
    let (r, g) = end(s);
    ck(r, "end capture");
    let mut exec = std::ptr::null_mut();
    // SAFETY: graph handles from the capture.
    unsafe {
        ck(cuGraphInstantiateWithFlags(&mut exec, g, 0), "instantiate");
        for _ in 0..2 {
            ck(cuMemsetD8Async(out, 0, 32, s), "reset");
            ck(cuGraphLaunch(exec, s), "launch");
            sync(s);
            assert_eq!(download(out, 32), [9; 32]);
        }
    }
    if child().as_deref() == Some("graph-uaf") {
        // SAFETY: after the launch's free node: the misuse under test.
        unsafe { cuMemsetD8Async(p, 0, 32, s) };
        sync(s);
        return;
    }
    let outcome = run_child(
        "graph_allocations_are_live_only_between_their_nodes",
        "graph-uaf",
        &[],
    );
    assert_aborts(&outcome, &["graph's free node", "cuMemsetD8Async"]);
}

#[test]
fn graph_memory_counts_from_its_launch_until_a_trim_finds_it_unused() {
    let _serial = serial();
    use_device(5);
    let s = stream(1);
    let free_now = || {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two out-pointers.
        ck(
            unsafe { cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        );
        free
    };
    let before = free_now();
    let mut p = 0;
    begin(s, GLOBAL);
    // SAFETY: a graph allocation used between its nodes.
    unsafe {
        ck(cuMemAllocAsync(&mut p, 1 << 20, s), "alloc node");
        ck(cuMemsetD8Async(p, 1, 1 << 20, s), "memset");
        ck(cuMemFreeAsync(p, s), "free node");
    }
    let (r, g) = end(s);
    ck(r, "end capture");
    assert_eq!(free_now(), before, "capture alone takes no memory");
    let mut exec = std::ptr::null_mut();
    // SAFETY: graph handles from the capture; device 5 exists.
    unsafe {
        ck(cuGraphInstantiateWithFlags(&mut exec, g, 0), "instantiate");
        ck(cuGraphLaunch(exec, s), "launch");
        sync(s);
        assert_eq!(free_now(), before - (1 << 20), "kept after the launch");
        let mut reserved = 0u64;
        ck(
            cuDeviceGetGraphMemAttribute(
                5,
                cudarc::driver::sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                (&mut reserved as *mut u64).cast(),
            ),
            "attribute",
        );
        assert_eq!(reserved, 1 << 20);
        ck(cuDeviceGraphMemTrim(5), "trim");
        assert_eq!(free_now(), before, "given back by the trim");
        // A launch takes it again; a trim while a launch is queued keeps it.
        let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        unsafe extern "C" fn hold(flag: *mut std::ffi::c_void) {
            let flag = &*(flag as *const std::sync::atomic::AtomicBool);
            while !flag.load(std::sync::atomic::Ordering::Acquire) {
                std::thread::yield_now();
            }
        }
        ck(
            cuLaunchHostFunc(s, Some(hold), std::sync::Arc::as_ptr(&gate) as *mut _),
            "hold",
        );
        ck(cuGraphLaunch(exec, s), "launch behind the hold");
        ck(cuDeviceGraphMemTrim(5), "trim while queued");
        gate.store(true, std::sync::atomic::Ordering::Release);
        sync(s);
        assert_eq!(free_now(), before - (1 << 20), "kept by the queued launch");
        ck(cuDeviceGraphMemTrim(5), "trim");
        assert_eq!(free_now(), before);
        ck(cuGraphExecDestroy(exec), "destroy exec");
        ck(cuGraphDestroy(g), "destroy graph");
    }
}
