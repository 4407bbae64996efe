//! Stream memory operations as CUDA documents them (`cuStreamWaitValue32_v2`,
//! `cuStreamWriteValue32_v2`): a wait blocks its stream until the word meets its condition (each
//! of GEQ, EQ, AND, NOR, GEQ cyclically), whoever writes it (the host in pinned memory, another
//! stream in device memory); writes land in stream order; both are captured and replayed; a wait
//! nothing satisfies is named by the deadlock watchdog; bad words and flags are refused.

mod common;

use common::*;
use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};
use ncclreshard_emu::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const GEQ: u32 = 0;
const EQ: u32 = 1;
const AND: u32 = 2;
const NOR: u32 = 3;
const FLUSH: u32 = 1 << 30;

fn wait_value(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) -> CUresult {
    // SAFETY: a stream of the emulator and an address the test owns (or the misuse under test).
    unsafe { cuStreamWaitValue32_v2(s, addr, value, flags) }
}

fn write_value(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) -> CUresult {
    // SAFETY: as above.
    unsafe { cuStreamWriteValue32_v2(s, addr, value, flags) }
}

/// A pinned host word (as the loopback stand-in keeps its flags), its device address and an
/// atomic view of it for the host side.
fn pinned_word() -> (CUdeviceptr, &'static AtomicU32) {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer; the memory is never freed (the test's life).
    ck(unsafe { cuMemHostAlloc(&mut p, 64, 0x3) }, "cuMemHostAlloc");
    // SAFETY: 64 bytes of pinned memory, page-aligned, alive for the process; the emulator's
    // streams access it atomically too.
    let word = unsafe { AtomicU32::from_ptr(p.cast::<u32>()) };
    word.store(0, Ordering::SeqCst);
    (p as CUdeviceptr, word)
}

fn query(s: CUstream) -> CUresult {
    // SAFETY: a stream handle.
    unsafe { cuStreamQuery(s) }
}

/// Whether the stream becomes idle within `limit`.
fn idle_within(s: CUstream, limit: Duration) -> bool {
    let start = Instant::now();
    loop {
        if query(s) == CUresult::CUDA_SUCCESS {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Four cleared device bytes (cleared before any stream waits: a context synchronization
/// would wait for the blocked stream too).
fn cleared() -> CUdeviceptr {
    let marker = alloc(4);
    // SAFETY: device memory of this context.
    unsafe {
        ck(cuMemsetD8_v2(marker, 0, 4), "clear");
        ck(cuCtxSynchronize(), "sync");
    }
    marker
}

#[test]
fn a_wait_blocks_its_stream_until_the_host_writes_the_word() {
    use_device(0);
    let s = stream(1);
    let (addr, word) = pinned_word();
    let marker = cleared();
    ck(wait_value(s, addr, 7, EQ), "wait");
    // SAFETY: device memory of this context, on the stream, after the wait.
    ck(unsafe { cuMemsetD8Async(marker, 0x5a, 4, s) }, "marker");
    // The stream must hold here: if the wait did not block, the marker lands and the stream
    // empties at once.
    assert!(
        !idle_within(s, Duration::from_millis(200)),
        "the stream went past a wait whose condition is false"
    );
    assert_eq!(query(s), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(download(marker, 4), [0; 4], "work after the wait ran early");
    word.store(6, Ordering::SeqCst);
    assert!(
        !idle_within(s, Duration::from_millis(50)),
        "EQ 7 passed on 6"
    );
    word.store(7, Ordering::SeqCst);
    assert!(
        idle_within(s, Duration::from_secs(2)),
        "the wait never saw the host's write"
    );
    assert_eq!(download(marker, 4), [0x5a; 4]);
}

#[test]
fn each_condition_passes_exactly_when_cuda_says() {
    use_device(1);
    let (addr, word) = pinned_word();
    // (stored word, flags, value, passes)
    let cases = [
        (5, GEQ, 5, true),
        (6, GEQ, 5, true),
        (4, GEQ, 5, false),
        // Cyclic: 2 - 0xffff_fff0 is 18 as an int32.
        (2, GEQ, 0xffff_fff0, true),
        (0xffff_fff0, GEQ, 2, false),
        (3, EQ, 3, true),
        (4, EQ, 3, false),
        (0b0110, AND, 0b0100, true),
        (0b0011, AND, 0b0100, false),
        // NOR: ~(word | value) != 0, false only when word | value has every bit set.
        (0x0000_ffff, NOR, 0xffff_0000, false),
        (0x0000_fff0, NOR, 0xffff_0000, true),
    ];
    for (stored, flags, value, passes) in cases {
        word.store(stored, Ordering::SeqCst);
        let s = stream(1);
        ck(wait_value(s, addr, value, flags), "wait");
        let went = idle_within(s, Duration::from_millis(if passes { 2000 } else { 100 }));
        assert_eq!(
            went, passes,
            "word {stored:#x}, flags {flags}, value {value:#x}"
        );
        if !passes {
            // Released by a word that meets the condition (for NOR here: no bit set).
            word.store(if flags == NOR { 0 } else { value }, Ordering::SeqCst);
            assert!(idle_within(s, Duration::from_secs(2)), "flags {flags}");
        }
    }
}

#[test]
fn one_stream_releases_another_through_device_memory_in_stream_order() {
    use_device(2);
    let flag = alloc(4);
    let data = alloc(256);
    let copy = alloc(256);
    let (waiter, writer) = (stream(1), stream(1));
    let bytes: Vec<u8> = (0..=255).collect();
    // SAFETY: device memory of this context.
    unsafe {
        ck(cuMemsetD8_v2(flag, 0, 4), "clear flag");
        ck(cuMemsetD8_v2(copy, 0, 256), "clear copy");
        ck(cuCtxSynchronize(), "sync");
    }
    // The waiter copies `data` once the writer says it is there; the writer fills it first,
    // then sets the flag: a write in stream order, after the upload.
    ck(wait_value(waiter, flag, 1, GEQ), "wait");
    // SAFETY: device memory of this context.
    ck(
        unsafe { cuMemcpyDtoDAsync_v2(copy, data, 256, waiter) },
        "copy",
    );
    assert!(!idle_within(waiter, Duration::from_millis(100)));
    upload_async(data, &bytes, writer);
    ck(write_value(writer, flag, 1, 0), "write");
    assert!(idle_within(waiter, Duration::from_secs(2)));
    sync(writer);
    assert_eq!(download(copy, 256), bytes);
    assert_eq!(download(flag, 4), 1u32.to_le_bytes());
}

#[test]
fn captured_waits_and_writes_replay_at_every_launch() {
    // The loopback stand-in's rendezvous in a graph: each launch waits for its release, resets
    // the word for the next launch, copies, and says it is done.
    use_device(3);
    let s = stream(1);
    let (ready, ready_word) = pinned_word();
    let (done, done_word) = pinned_word();
    let src = alloc(64);
    let dst = alloc(64);
    // SAFETY: device memory of this context; graph handles from the capture, destroyed below.
    unsafe {
        ck(cuMemsetD8_v2(dst, 0, 64), "clear");
        ck(cuCtxSynchronize(), "sync");
        ck(cuStreamBeginCapture_v2(s, 0), "begin capture");
        ck(wait_value(s, ready, 1, EQ), "wait");
        ck(write_value(s, ready, 0, 0), "reset");
        ck(cuMemcpyDtoDAsync_v2(dst, src, 64, s), "copy");
        ck(write_value(s, done, 1, 0), "done");
        let mut graph = std::ptr::null_mut();
        ck(cuStreamEndCapture(s, &mut graph), "end capture");
        let mut n = 0;
        ck(
            cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n),
            "nodes",
        );
        assert_eq!(n, 4, "each operation is a node");
        assert_eq!(
            done_word.load(Ordering::SeqCst),
            0,
            "nothing ran at capture"
        );
        let mut exec = std::ptr::null_mut();
        ck(
            cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            "instantiate",
        );
        for launch in 0..3u8 {
            upload_async(src, &[launch + 1; 64], s);
            ck(cuGraphLaunch(exec, s), "launch");
            assert!(
                !idle_within(s, Duration::from_millis(100)),
                "launch {launch} ran past its wait"
            );
            done_word.store(0, Ordering::SeqCst);
            ready_word.store(1, Ordering::SeqCst);
            assert!(idle_within(s, Duration::from_secs(2)), "launch {launch}");
            assert_eq!(ready_word.load(Ordering::SeqCst), 0, "the replay resets it");
            assert_eq!(done_word.load(Ordering::SeqCst), 1);
            assert_eq!(download(dst, 64), [launch + 1; 64]);
        }
        ck(cuGraphExecDestroy(exec), "destroy exec");
        ck(cuGraphDestroy(graph), "destroy graph");
    }
}

#[test]
fn a_wait_nothing_satisfies_is_named_by_the_deadlock_watchdog() {
    if child().as_deref() == Some("stuck") {
        use_device(4);
        let s = stream(1);
        let (addr, _) = pinned_word();
        ck(wait_value(s, addr, 3, EQ), "wait");
        std::thread::sleep(Duration::from_secs(30));
        return;
    }
    let out = run_child(
        "a_wait_nothing_satisfies_is_named_by_the_deadlock_watchdog",
        "stuck",
        &[("NCCL_RESHARD_EMU_DEADLOCK_SECONDS", "1")],
    );
    assert_aborts(
        &out,
        &[
            "deadlock: stream work is waiting",
            "cuStreamWaitValue32_v2 until *0x",
            "== 0x3 (EQ)",
            "the word holds 0x0",
            "pinned host memory",
            "(device 4, non-blocking)",
        ],
    );
}

#[test]
fn bad_words_and_flags_are_refused_and_words_outside_live_memory_abort() {
    const TEST: &str = "bad_words_and_flags_are_refused_and_words_outside_live_memory_abort";
    if let Some(scenario) = child() {
        use_device(5);
        let s = stream(1);
        match scenario.as_str() {
            "refused" => {
                // Errors at the call, nothing enqueued (in return mode: the misuse is reported).
                let p = alloc(64);
                for (result, what) in [
                    (wait_value(s, p + 2, 0, GEQ), "unaligned wait"),
                    (write_value(s, p + 1, 0, 0), "unaligned write"),
                    (wait_value(s, p, 0, 4), "wait flags 4"),
                    (write_value(s, p, 0, 2), "write flags 2"),
                ] {
                    assert_eq!(result, CUresult::CUDA_ERROR_INVALID_VALUE, "{what}");
                }
                assert_eq!(
                    wait_value(s, p, 0, GEQ | FLUSH),
                    CUresult::CUDA_ERROR_NOT_SUPPORTED
                );
                assert!(
                    idle_within(s, Duration::from_secs(1)),
                    "nothing was enqueued"
                );
                println!("child done");
                return;
            }
            "past the end" => {
                let p = alloc(66);
                wait_value(s, p + 64, 0, GEQ);
            }
            "pageable" => {
                let word = Box::leak(Box::new(0u32));
                write_value(s, word as *mut u32 as CUdeviceptr, 1, 0);
            }
            "other device" => {
                use_device(6);
                let elsewhere = alloc(64);
                use_device(5);
                // Checked when the work runs: the stream's device may not access it.
                write_value(s, elsewhere, 1, 0);
                sync(s);
            }
            other => panic!("unknown scenario {other}"),
        }
        std::thread::sleep(Duration::from_secs(5));
        return;
    }
    let out = run_child(TEST, "refused", &[("NCCL_RESHARD_EMU_ON_ERROR", "return")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("is not 4-byte aligned"), "{stderr}");
    assert!(stderr.contains("CU_STREAM_WAIT_VALUE_FLUSH"), "{stderr}");
    for (scenario, needles) in [
        (
            "past the end",
            &[
                "cuStreamWaitValue32_v2",
                "out of bounds",
                "cuMemAlloc_v2 (66 bytes)",
            ][..],
        ),
        (
            "pageable",
            &[
                "cuStreamWriteValue32_v2",
                "no allocation holds this address",
                "pageable host memory",
            ][..],
        ),
        (
            "other device",
            &["cuStreamWriteValue32_v2", "the memory is not on device 5"][..],
        ),
    ] {
        assert_aborts(&run_child(TEST, scenario, &[]), needles);
    }
}
