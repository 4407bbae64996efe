//! The stand-in on a CUDA driver (the emulator's in CI: scripts/emulated-gpu-tests.sh sets
//! LD_LIBRARY_PATH to target/emu/lib and runs these with `--ignored`; a real GPU works too):
//! ranks as threads on one device, sends and receives matched in issue order and byte-exact,
//! a copy that waits for both streams and a stream that waits for its copies, graph capture and
//! replay, nonblocking communicators, revoke, shrink and grow, and the loud failures (size
//! mismatch, captured against eager, hangs named by the watchdog). Scenarios that must abort
//! run in a child process (the test binary again, `LOOPBACK_TEST_CHILD` naming the scenario).

use cudarc::driver::sys::{self, CUdeviceptr, CUresult, CUstream};
use ncclreshard_loopback::api::{NcclComm, NcclUniqueId};
use ncclreshard_loopback::*;
use std::ffi::{c_int, c_void, CStr};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};

const UINT8: c_int = 1;
const FLOAT32: c_int = 7;
const IN_PROGRESS: c_int = 7;
const INVALID_ARGUMENT: c_int = 4;
const INVALID_USAGE: c_int = 5;

fn ck(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

fn nc(r: c_int, what: &str) {
    assert_eq!(r, 0, "{what}: {}", last_error());
}

fn last_error() -> String {
    // SAFETY: the stand-in returns its static buffer.
    unsafe { CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

/// Device 0's primary context, current on this thread (every rank shares it: the point).
fn device() -> sys::CUcontext {
    static CTX: OnceLock<usize> = OnceLock::new();
    let ctx = *CTX.get_or_init(|| {
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            ck(sys::cuInit(0), "cuInit");
            let mut ctx = std::ptr::null_mut();
            ck(sys::cuDevicePrimaryCtxRetain(&mut ctx, 0), "retain");
            ctx as usize
        }
    }) as sys::CUcontext;
    // SAFETY: a retained primary context.
    ck(unsafe { sys::cuCtxSetCurrent(ctx) }, "set current");
    ctx
}

fn stream() -> CUstream {
    device();
    let mut s = std::ptr::null_mut();
    // SAFETY: writes one handle (kept for the process's life).
    ck(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate");
    s
}

/// Device memory holding `bytes`, copied on `s` once it is idle (kept for the process's life: a
/// free would wait for every rank's stream of the shared device).
fn upload(bytes: &[u8], s: CUstream) -> CUdeviceptr {
    device();
    let mut p = 0;
    // SAFETY: an allocation and a copy of `bytes` into it on our stream, waited for.
    unsafe {
        ck(sys::cuMemAlloc_v2(&mut p, bytes.len().max(1)), "alloc");
        sync(s);
        ck(
            sys::cuMemcpyHtoDAsync_v2(p, bytes.as_ptr().cast(), bytes.len(), s),
            "upload",
        );
    }
    sync(s);
    p
}

/// `len` bytes at `p`, copied on `s` once it is idle (a copy to pageable memory that waited for
/// a stream held by peers could hold up the driver's staging buffers other ranks need).
fn download(p: CUdeviceptr, len: usize, s: CUstream) -> Vec<u8> {
    sync(s);
    let mut out = vec![0u8; len];
    // SAFETY: `out` is writable; the copy is ordered on `s` and waited for.
    unsafe {
        ck(
            sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), p, len, s),
            "download",
        );
    }
    sync(s);
    out
}

fn sync(s: CUstream) {
    // SAFETY: a stream of ours.
    ck(unsafe { sys::cuStreamSynchronize(s) }, "sync");
}

fn unique_id() -> NcclUniqueId {
    let mut id = NcclUniqueId { internal: [0; 128] };
    // SAFETY: writes 128 bytes.
    nc(unsafe { ncclGetUniqueId(&mut id) }, "ncclGetUniqueId");
    id
}

/// Runs `f(rank, comm)` for `n` ranks, one thread each, all on device 0, with a communicator
/// of a fresh id (destroyed after).
fn ranks<T: Send>(n: usize, f: impl Fn(usize, NcclComm) -> T + Sync) -> Vec<T> {
    let id = unique_id();
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = (0..n)
            .map(|r| {
                scope.spawn(move || {
                    device();
                    let mut comm = std::ptr::null_mut();
                    // SAFETY: writes one handle.
                    nc(
                        unsafe { ncclCommInitRank(&mut comm, n as c_int, id, r as c_int) },
                        "init",
                    );
                    let out = f(r, comm);
                    // SAFETY: our communicator, destroyed once.
                    nc(unsafe { ncclCommDestroy(comm) }, "destroy");
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

fn send(buf: CUdeviceptr, bytes: usize, peer: usize, comm: NcclComm, s: CUstream) -> c_int {
    // SAFETY: device memory of `bytes` bytes, our communicator and stream.
    unsafe {
        ncclSend(
            buf as *const c_void,
            bytes,
            UINT8,
            peer as c_int,
            comm,
            s.cast(),
        )
    }
}

fn recv(buf: CUdeviceptr, bytes: usize, peer: usize, comm: NcclComm, s: CUstream) -> c_int {
    // SAFETY: as above.
    unsafe {
        ncclRecv(
            buf as *mut c_void,
            bytes,
            UINT8,
            peer as c_int,
            comm,
            s.cast(),
        )
    }
}

fn pattern(from: usize, to: usize, round: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 7 + from * 31 + to * 17 + round * 101) as u8)
        .collect()
}

/// The scenario this process must run, when it is a child.
fn child() -> Option<String> {
    std::env::var("LOOPBACK_TEST_CHILD").ok()
}

fn run_child(test: &str, scenario: &str, env: &[(&str, &str)]) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LOOPBACK_TEST_CHILD", scenario)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn assert_aborts(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the child should have aborted:\n{stderr}"
    );
    for n in needles {
        assert!(
            stderr.contains(n),
            "the report should mention {n:?}:\n{stderr}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn all_to_all_rounds_are_byte_exact_matched_in_issue_order() {
    // Four ranks on one device, three rounds as groups: each rank sends to every rank (itself
    // included) and receives from every rank; the n-th send of a pair meets its n-th receive
    // across groups, and in each group a rank posts first for some pairs, second for others.
    const N: usize = 4;
    const LEN: usize = 4099;
    let start = Barrier::new(N);
    ranks(N, |r, comm| {
        let s = stream();
        let sends: Vec<Vec<CUdeviceptr>> = (0..3)
            .map(|round| {
                (0..N)
                    .map(|p| upload(&pattern(r, p, round, LEN), s))
                    .collect()
            })
            .collect();
        let recvs: Vec<Vec<CUdeviceptr>> = (0..3)
            .map(|_| (0..N).map(|_| upload(&[0u8; LEN], s)).collect())
            .collect();
        start.wait();
        for round in 0..3 {
            // Ranks stagger their posts so that who posts first differs by pair and round.
            std::thread::sleep(Duration::from_millis(((r + round) % N) as u64 * 5));
            nc(ncclGroupStart(), "group start");
            for k in 0..N {
                let p = (r + k) % N;
                nc(send(sends[round][p], LEN, p, comm, s), "send");
                nc(recv(recvs[round][p], LEN, p, comm, s), "recv");
            }
            nc(ncclGroupEnd(), "group end");
        }
        for (round, received) in recvs.iter().enumerate() {
            for (p, &buf) in received.iter().enumerate() {
                assert_eq!(
                    download(buf, LEN, s),
                    pattern(p, r, round, LEN),
                    "rank {r} round {round} from {p}"
                );
            }
        }
    });
}

/// A host word a stream waits at (`cuStreamWaitValue32_v2` on pinned memory): the test holds a
/// rank's stream before its group.
struct Gate(&'static AtomicU32, CUdeviceptr);

impl Gate {
    fn new() -> Gate {
        device();
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; kept for the process's life.
        ck(unsafe { sys::cuMemHostAlloc(&mut p, 64, 3) }, "host alloc");
        // SAFETY: pinned, aligned, alive for the process's life; streams access it too.
        let word = unsafe { AtomicU32::from_ptr(p.cast()) };
        word.store(0, Ordering::SeqCst);
        Gate(word, p as CUdeviceptr)
    }
    fn hold(&self, s: CUstream) {
        // SAFETY: our pinned word.
        ck(
            unsafe { sys::cuStreamWaitValue32_v2(s, self.1, 1, 1) },
            "gate",
        );
    }
    fn open(&self) {
        self.0.store(1, Ordering::SeqCst);
    }
}

fn idle(s: CUstream) -> bool {
    // SAFETY: a stream of ours.
    unsafe { sys::cuStreamQuery(s) == CUresult::CUDA_SUCCESS }
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn the_copy_waits_for_both_streams_and_each_stream_for_the_copy() {
    // Rank 0 sends what its stream writes just before the group; its stream is held at a gate,
    // so the data is not there until the gate opens. Rank 1 receives and then copies what it
    // received elsewhere on its stream. If the copy ran before rank 0's stream reached the
    // group, or rank 1's stream passed the group before the copy, the bytes would be stale.
    const LEN: usize = 1 << 16;
    let gate = Gate::new();
    let posted = Barrier::new(2);
    let checked = Barrier::new(2);
    ranks(2, |r, comm| {
        let s = stream();
        if r == 0 {
            let data = upload(&vec![0xee; LEN], s);
            // Pinned, so the copy from it waits for the stream without holding up the host.
            let mut fresh: *mut c_void = std::ptr::null_mut();
            // SAFETY: LEN bytes of pinned memory (kept for the process's life), filled before
            // any stream uses them.
            unsafe {
                ck(sys::cuMemHostAlloc(&mut fresh, LEN, 0), "pinned");
                let bytes = pattern(0, 1, 9, LEN);
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), fresh.cast::<u8>(), LEN);
            }
            gate.hold(s);
            // SAFETY: device memory of LEN bytes and pinned memory that outlives the copy.
            ck(
                unsafe { sys::cuMemcpyHtoDAsync_v2(data, fresh, LEN, s) },
                "fill",
            );
            nc(send(data, LEN, 1, comm, s), "send");
            posted.wait();
            checked.wait();
            gate.open();
            sync(s);
        } else {
            let got = upload(&[0u8; LEN], s);
            let after = upload(&[0u8; LEN], s);
            posted.wait();
            nc(recv(got, LEN, 0, comm, s), "recv");
            // SAFETY: device memory of this context, ordered after the receive.
            ck(
                unsafe { sys::cuMemcpyDtoDAsync_v2(after, got, LEN, s) },
                "copy after",
            );
            std::thread::sleep(Duration::from_millis(200));
            assert!(
                !idle(s),
                "rank 1's stream passed a receive whose sender is held"
            );
            checked.wait();
            assert_eq!(download(after, LEN, s), pattern(0, 1, 9, LEN));
        }
    });
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn captured_exchanges_replay_at_every_launch() {
    // Both ranks capture a group (a swap) on a stream of their own, then launch the graph
    // three times with new data each time: every replay moves the bytes again.
    const LEN: usize = 1000;
    let captured = Barrier::new(2);
    ranks(2, |r, comm| {
        let s = stream();
        let peer = 1 - r;
        let out = upload(&[0u8; LEN], s);
        let inp = upload(&[0u8; LEN], s);
        // SAFETY: capture on our stream (thread-local: the other rank allocates meanwhile);
        // graph handles destroyed below.
        unsafe {
            ck(
                sys::cuStreamBeginCapture_v2(
                    s,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "begin",
            );
            nc(ncclGroupStart(), "group start");
            nc(send(out, LEN, peer, comm, s), "send");
            nc(recv(inp, LEN, peer, comm, s), "recv");
            nc(ncclGroupEnd(), "group end");
            let mut graph = std::ptr::null_mut();
            ck(sys::cuStreamEndCapture(s, &mut graph), "end");
            let mut exec = std::ptr::null_mut();
            ck(
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "instantiate",
            );
            captured.wait();
            for launch in 0..3 {
                let mine = pattern(r, peer, launch, LEN);
                ck(
                    sys::cuMemcpyHtoDAsync_v2(out, mine.as_ptr().cast(), LEN, s),
                    "fill",
                );
                ck(sys::cuGraphLaunch(exec, s), "launch");
                assert_eq!(
                    download(inp, LEN, s),
                    pattern(peer, r, launch, LEN),
                    "launch {launch}"
                );
                captured.wait();
            }
            ck(sys::cuGraphExecDestroy(exec), "destroy exec");
            ck(sys::cuGraphDestroy(graph), "destroy graph");
        }
    });
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn nonblocking_communicators_report_progress_through_the_async_error() {
    const LEN: usize = 256;
    let id = unique_id();
    std::thread::scope(|scope| {
        for r in 0..2usize {
            scope.spawn(move || {
                device();
                let s = stream();
                let mut config = [0u8; 64];
                config[..8].copy_from_slice(&64usize.to_le_bytes());
                config[8..12].copy_from_slice(&0xcafe_beefu32.to_le_bytes());
                config[12..16].copy_from_slice(&21800u32.to_le_bytes());
                config[16..20].copy_from_slice(&0i32.to_le_bytes());
                let mut comm = std::ptr::null_mut();
                let settle = |comm: NcclComm, mut state: c_int| {
                    while state == IN_PROGRESS {
                        // SAFETY: our communicator.
                        nc(unsafe { ncclCommGetAsyncError(comm, &mut state) }, "async");
                        std::thread::yield_now();
                    }
                    assert_eq!(state, 0);
                };
                // SAFETY: a config with NCCL's header and blocking = 0.
                let r0 = unsafe {
                    ncclCommInitRankConfig(&mut comm, 2, id, r as c_int, config.as_mut_ptr().cast())
                };
                assert_eq!(r0, IN_PROGRESS, "a nonblocking init is in progress");
                settle(comm, r0);
                let data = upload(&pattern(r, 1 - r, 0, LEN), s);
                let got = upload(&[0u8; LEN], s);
                nc(ncclGroupStart(), "start");
                nc(send(data, LEN, 1 - r, comm, s), "send");
                nc(recv(got, LEN, 1 - r, comm, s), "recv");
                let ended = ncclGroupEnd();
                assert_eq!(
                    ended, IN_PROGRESS,
                    "a nonblocking group is issued in the background"
                );
                settle(comm, ended);
                assert_eq!(download(got, LEN, s), pattern(1 - r, r, 0, LEN));
                // SAFETY: our communicator.
                nc(unsafe { ncclCommDestroy(comm) }, "destroy");
            });
        }
    });
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn a_revoke_ends_an_unmatched_operation_and_refuses_new_ones_and_shrink_and_grow_work() {
    const LEN: usize = 64;
    let grow_id = Mutex::new(None);
    let offered = Barrier::new(2);
    // Rank 2 dies (does nothing after its init); ranks 0 and 1 survive.
    let outcome = ranks(3, |r, comm| {
        if r == 2 {
            return None;
        }
        let s = stream();
        let buf = upload(&[r as u8; LEN], s);
        if r == 0 {
            // A receive the dead rank will not match: the stream waits until the revoke
            // releases it.
            nc(recv(buf, LEN, 2, comm, s), "recv");
            std::thread::sleep(Duration::from_millis(100));
            assert!(!idle(s), "an unmatched receive let its stream go on");
            let revoked = Instant::now();
            // SAFETY: our communicator.
            nc(unsafe { ncclCommRevoke(comm, 0) }, "revoke");
            sync(s);
            assert!(revoked.elapsed() < Duration::from_secs(5));
            assert_eq!(
                send(buf, LEN, 1, comm, s),
                INVALID_USAGE,
                "posted after a revoke"
            );
            assert!(last_error().contains("was revoked"), "{}", last_error());
        }
        // A shrink must exclude a rank, as NCCL's does (an empty list: ncclInvalidArgument).
        let mut shrunk = std::ptr::null_mut();
        // SAFETY: our communicator; an empty exclusion list.
        let empty = unsafe {
            ncclCommShrink(
                comm,
                std::ptr::null_mut(),
                0,
                &mut shrunk,
                std::ptr::null_mut(),
                1,
            )
        };
        assert_eq!(empty, INVALID_ARGUMENT, "a shrink excluding no rank");
        assert!(shrunk.is_null());
        // The survivors shrink excluding the dead rank (rank 0's parent is revoked:
        // NCCL_SHRINK_ABORT).
        let mut dead = [2];
        // SAFETY: our communicator; a list of one rank.
        nc(
            unsafe {
                ncclCommShrink(
                    comm,
                    dead.as_mut_ptr(),
                    1,
                    &mut shrunk,
                    std::ptr::null_mut(),
                    1,
                )
            },
            "shrink",
        );
        // The grow: rank 0 coordinates, a new rank 2 joins on a thread of its own.
        if r == 0 {
            let mut id = NcclUniqueId { internal: [0; 128] };
            // SAFETY: our communicator.
            nc(unsafe { ncclCommGetUniqueId(shrunk, &mut id) }, "grow id");
            *grow_id.lock().unwrap() = Some(id.internal);
        }
        offered.wait();
        let id = NcclUniqueId {
            internal: grow_id.lock().unwrap().unwrap(),
        };
        let newcomer = (r == 0).then(|| {
            std::thread::spawn(move || {
                device();
                let mut grown = std::ptr::null_mut();
                // SAFETY: a new rank with the coordinator's id.
                nc(
                    unsafe {
                        ncclCommGrow(
                            std::ptr::null_mut(),
                            3,
                            &id,
                            2,
                            &mut grown,
                            std::ptr::null_mut(),
                        )
                    },
                    "grow (new rank)",
                );
                grown as usize
            })
        });
        let mut grown = std::ptr::null_mut();
        let coordinator = if r == 0 {
            &id as *const NcclUniqueId
        } else {
            std::ptr::null()
        };
        // SAFETY: our shrunk communicator.
        nc(
            unsafe { ncclCommGrow(shrunk, 3, coordinator, -1, &mut grown, std::ptr::null_mut()) },
            "grow",
        );
        let mut count = 0;
        // SAFETY: our grown communicator.
        nc(unsafe { ncclCommCount(grown, &mut count) }, "count");
        let newcomer = newcomer.map(|h| h.join().unwrap());
        // SAFETY: communicators of ours, each destroyed once.
        unsafe {
            nc(ncclCommDestroy(grown), "destroy grown");
            nc(ncclCommDestroy(shrunk), "destroy shrunk");
            if let Some(n) = newcomer {
                nc(ncclCommDestroy(n as NcclComm), "destroy newcomer");
            }
        }
        Some(count)
    });
    assert_eq!(outcome, [Some(3), Some(3), None]);
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn a_destroy_waits_for_the_ranks_operations_as_nccls_finalize_does() {
    const LEN: usize = 512;
    let id = unique_id();
    let late = Duration::from_millis(300);
    let waited = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2usize)
            .map(|r| {
                scope.spawn(move || {
                    device();
                    let s = stream();
                    let mut comm = std::ptr::null_mut();
                    // SAFETY: writes one handle.
                    nc(
                        unsafe { ncclCommInitRank(&mut comm, 2, id, r as c_int) },
                        "init",
                    );
                    let buf = upload(&pattern(r, 1 - r, 3, LEN), s);
                    if r == 1 {
                        std::thread::sleep(late);
                        nc(recv(buf, LEN, 0, comm, s), "recv");
                        sync(s);
                        assert_eq!(download(buf, LEN, s), pattern(0, 1, 3, LEN));
                    } else {
                        nc(send(buf, LEN, 1, comm, s), "send");
                    }
                    let started = Instant::now();
                    // SAFETY: our communicator, destroyed once (rank 0's send still pending).
                    nc(unsafe { ncclCommDestroy(comm) }, "destroy");
                    started.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        waited[0] >= late / 2,
        "rank 0's destroy returned before its send was received ({:?})",
        waited[0]
    );
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn refusals_are_clear_errors() {
    // NCCL's last error is one buffer for the whole process, and so is the stand-in's: a rank
    // reads it under this lock, taken before its refused call, or the other rank's next refusal
    // may overwrite the text first.
    let last_error_is_mine = Mutex::new(());
    ranks(2, |r, comm| {
        let s = stream();
        let buf = upload(&[0u8; 16], s);
        {
            let _mine = last_error_is_mine.lock().unwrap();
            assert_eq!(
                send(buf, 16, 2, comm, s),
                INVALID_ARGUMENT,
                "peer out of range"
            );
            assert!(
                last_error().contains("peer 2 is out of range"),
                "{}",
                last_error()
            );
        }
        assert_eq!(
            ncclGroupEnd(),
            INVALID_USAGE,
            "ncclGroupEnd outside a group"
        );
        {
            let _mine = last_error_is_mine.lock().unwrap();
            // SAFETY: our communicator and buffers.
            let reduced = unsafe {
                ncclAllReduce(
                    buf as *const c_void,
                    buf as *mut c_void,
                    4,
                    FLOAT32,
                    0,
                    comm,
                    s.cast(),
                )
            };
            assert_eq!(reduced, INVALID_USAGE, "no collectives");
            assert!(
                last_error().contains("point-to-point operations only"),
                "{}",
                last_error()
            );
        }
        // An error inside a group is the group's: its end returns it and issues nothing.
        nc(ncclGroupStart(), "start");
        nc(send(buf, 16, 1 - r, comm, s), "send");
        // SAFETY: as above.
        unsafe {
            ncclAllReduce(
                buf as *const c_void,
                buf as *mut c_void,
                4,
                FLOAT32,
                0,
                comm,
                s.cast(),
            )
        };
        assert_eq!(ncclGroupEnd(), INVALID_USAGE, "the group's error");
        sync(s);
        {
            let _mine = last_error_is_mine.lock().unwrap();
            // A receive from self without its send in the same group: NCCL refuses it.
            assert_eq!(
                recv(buf, 16, r, comm, s),
                INVALID_USAGE,
                "an unmatched self receive"
            );
            assert!(
                last_error().contains("without a matching send"),
                "{}",
                last_error()
            );
        }
        // Paired in one group, self messages are fine.
        nc(ncclGroupStart(), "start");
        nc(send(buf, 8, r, comm, s), "self send");
        nc(recv(buf + 8, 8, r, comm, s), "self recv");
        nc(ncclGroupEnd(), "self pair");
        sync(s);
        let mut version = 0;
        // SAFETY: writes one int.
        nc(unsafe { ncclGetVersion(&mut version) }, "version");
        assert!(
            version >= 22902,
            "revoke, shrink and grow exist from 2.29.2"
        );
        assert_eq!(ncclreshardLoopback(), 1);
    });
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn a_group_larger_than_the_flag_pool_is_refused_whole() {
    const TEST: &str = "a_group_larger_than_the_flag_pool_is_refused_whole";
    if child().is_none() {
        let out = run_child(TEST, "pool of 4", &[("NCCL_LOOPBACK_SLOTS", "4")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("raise NCCL_LOOPBACK_SLOTS"), "{stderr}");
        return;
    }
    const LEN: usize = 32;
    let refused = Barrier::new(2);
    ranks(2, |r, comm| {
        let s = stream();
        let bufs: Vec<CUdeviceptr> = (0..5)
            .map(|k| upload(&pattern(r, 1 - r, k, LEN), s))
            .collect();
        if r == 0 {
            nc(ncclGroupStart(), "start");
            for &b in &bufs {
                nc(send(b, LEN, 1, comm, s), "send");
            }
            assert_eq!(
                ncclGroupEnd(),
                3,
                "ncclInternalError: 5 operations, 4 slots"
            );
            refused.wait();
            // Nothing of the refused group was matched: the next sends are the pair's first.
            nc(ncclGroupStart(), "start");
            nc(send(bufs[3], LEN, 1, comm, s), "send");
            nc(send(bufs[4], LEN, 1, comm, s), "send");
            nc(ncclGroupEnd(), "end");
            sync(s);
        } else {
            refused.wait();
            nc(ncclGroupStart(), "start");
            nc(recv(bufs[0], LEN, 0, comm, s), "recv");
            nc(recv(bufs[1], LEN, 0, comm, s), "recv");
            nc(ncclGroupEnd(), "end");
            assert_eq!(download(bufs[0], LEN, s), pattern(0, 1, 3, LEN));
            assert_eq!(download(bufs[1], LEN, s), pattern(0, 1, 4, LEN));
        }
    });
}

#[test]
#[ignore = "needs a CUDA driver (the emulator's: scripts/emulated-gpu-tests.sh)"]
fn what_nccl_would_hang_on_aborts_with_a_report() {
    const TEST: &str = "what_nccl_would_hang_on_aborts_with_a_report";
    if let Some(scenario) = child() {
        ranks(2, |r, comm| {
            let s = stream();
            let buf = upload(&[0u8; 64], s);
            match (scenario.as_str(), r) {
                ("size mismatch", 0) => nc(send(buf, 64, 1, comm, s), "send"),
                ("size mismatch", _) => {
                    std::thread::sleep(Duration::from_millis(100));
                    recv(buf, 32, 0, comm, s);
                }
                ("captured against eager", 0) => nc(send(buf, 64, 1, comm, s), "send"),
                ("captured against eager", _) => {
                    std::thread::sleep(Duration::from_millis(100));
                    // SAFETY: a capture on our stream.
                    unsafe {
                        ck(
                            sys::cuStreamBeginCapture_v2(
                                s,
                                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                            ),
                            "begin",
                        );
                    }
                    recv(buf, 64, 0, comm, s);
                }
                ("hang", 0) => nc(recv(buf, 64, 1, comm, s), "recv"),
                _ => {}
            }
            std::thread::sleep(Duration::from_secs(20));
        });
        return;
    }
    assert_aborts(
        &run_child(TEST, "size mismatch", &[]),
        &[
            "[ncclreshard-loopback",
            "message size mismatch",
            "rank 0 ncclSend of 64 bytes to rank 1",
            "rank 1 ncclRecv of 32 bytes from rank 0",
        ],
    );
    assert_aborts(
        &run_child(TEST, "captured against eager", &[]),
        &[
            "was issued during a CUDA graph capture but its match",
            "rank 0 ncclSend of 64 bytes",
        ],
    );
    assert_aborts(
        &run_child(
            TEST,
            "hang",
            &[
                ("NCCL_LOOPBACK_TIMEOUT_SECONDS", "1"),
                ("NCCL_RESHARD_EMU_DEADLOCK_SECONDS", "60"),
            ],
        ),
        &[
            "hang: operations are pending",
            "rank 0 ncclRecv of 64 bytes from rank 1",
            "rank 1 has not issued the matching ncclSend",
            "ready 0x",
        ],
    );
}
