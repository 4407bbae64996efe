//! NCCL as a user sees it, ranks as threads of one process: group nesting, point-to-point
//! rendezvous matched in issue order, collectives, non-blocking communicators, capture into
//! graphs, and the misuse the emulator refuses (truncated messages, mismatched collectives,
//! concurrent use of a communicator, deadlocks).

mod common;

use common::nccl::*;
use common::*;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use ncclreshard_emu::*;
use std::ffi::CStr;
use std::time::{Duration, Instant};

const FLOAT32: i32 = 7;
const BFLOAT16: i32 = 9;
const SUM: i32 = 0;

/// NCCL's last-error text is one process-wide buffer: tests that read it take turns.
fn error_text_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn last_error() -> String {
    // SAFETY: NCCL's static buffer.
    unsafe { CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn group_end_without_a_group_is_invalid_usage_and_changes_nothing() {
    let _turn = error_text_lock();
    // SAFETY: group calls, some unbalanced on purpose.
    unsafe {
        assert_eq!(ncclGroupEnd(), 5);
        assert_eq!(last_error(), "ncclGroupEnd: not in a group call.");
        assert_eq!(ncclGroupStart(), 0);
        assert_eq!(ncclGroupStart(), 0);
        assert_eq!(ncclGroupEnd(), 0);
        assert_eq!(ncclGroupEnd(), 0);
        assert_eq!(ncclGroupEnd(), 5);
        let mut v = 0;
        assert_eq!(ncclGetVersion(&mut v), 0);
        assert_eq!(v, 22907);
        assert_eq!(
            CStr::from_ptr(ncclGetErrorString(5)).to_str().unwrap(),
            "invalid usage (run with NCCL_DEBUG=WARN for details)"
        );
    }
}

#[test]
fn sends_match_receives_in_issue_order_across_groups() {
    let c = comms(2);
    let a: Vec<u8> = (0..100).collect();
    let b: Vec<u8> = (0..200).map(|i| 255 - i as u8).collect();
    let (pa, pb) = (on_device(0, &a), on_device(0, &b));
    let (x, y) = (on_device(1, &[0; 100]), on_device(1, &[0; 200]));
    group(|| {
        assert_eq!(send(pa, 100, 1, c[0]), 0);
        assert_eq!(send(pb, 200, 1, c[0]), 0);
    });
    // The receives come in a later group: still matched, in order.
    group(|| {
        assert_eq!(recv(x, 100, 0, c[1]), 0);
        assert_eq!(recv(y, 200, 0, c[1]), 0);
    });
    use_device(1);
    sync(c[1].1);
    assert_eq!(read(1, x, 100), a);
    assert_eq!(read(1, y, 200), b);
    // Self send/receive.
    let z = on_device(0, &[0; 100]);
    group(|| {
        assert_eq!(send(pa, 100, 0, c[0]), 0);
        assert_eq!(recv(z, 100, 0, c[0]), 0);
    });
    use_device(0);
    sync(c[0].1);
    assert_eq!(read(0, z, 100), a);
    // A self receive whose send is not in the same group: NCCL refuses it (the send's own
    // group would be refused the same way).
    let _turn = error_text_lock();
    assert_eq!(recv(z, 100, 0, c[0]), 5);
    assert!(
        last_error().contains("without a matching send"),
        "{}",
        last_error()
    );
    // SAFETY: balanced group calls.
    unsafe {
        assert_eq!(ncclGroupStart(), 0);
        assert_eq!(send(pa, 100, 0, c[0]), 0);
        assert_eq!(ncclGroupEnd(), 5);
    }
    assert!(
        last_error().contains("without a matching recv"),
        "{}",
        last_error()
    );
}

#[test]
fn ranks_as_threads_run_rings_and_collectives() {
    const N: usize = 4;
    let mut id = NcclUniqueId { internal: [0; 128] };
    // SAFETY: writes the id.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, 0);
    let results: Vec<(Vec<u8>, Vec<f32>, Vec<u8>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..N)
            .map(|r| {
                scope.spawn(move || {
                    // SAFETY: the runtime's device for this thread.
                    assert_eq!(unsafe { cudaSetDevice(r as i32) }, 0);
                    let mut comm = std::ptr::null_mut();
                    // SAFETY: blocks until all N ranks joined.
                    assert_eq!(
                        unsafe { ncclCommInitRank(&mut comm, N as i32, id, r as i32) },
                        0
                    );
                    let mut dev = -1;
                    // SAFETY: writes one int.
                    assert_eq!(unsafe { ncclCommCuDevice(comm, &mut dev) }, 0);
                    assert_eq!(dev, r as i32);
                    let s = stream(1);
                    let mine = alloc(64);
                    let theirs = alloc(64);
                    upload_async(mine, &[r as u8; 64], s);
                    let next = ((r + 1) % N) as i32;
                    let prev = ((r + N - 1) % N) as i32;
                    group(|| {
                        assert_eq!(send(mine, 64, next, (comm, s)), 0);
                        assert_eq!(recv(theirs, 64, prev, (comm, s)), 0);
                    });
                    let values: Vec<f32> = (0..8).map(|i| (i * (r + 1)) as f32).collect();
                    let fbuf = alloc(32);
                    upload_async(fbuf, as_bytes(&values), s);
                    let half: Vec<u16> = (0..8).map(|_| 0x3f80).collect(); // 1.0 in bf16
                    let hbuf = alloc(16);
                    upload_async(hbuf, as_bytes(&half), s);
                    let gathered = alloc(N);
                    // SAFETY: device buffers of this rank; in-place all-reduces.
                    unsafe {
                        assert_eq!(
                            ncclAllReduce(fbuf as _, fbuf as _, 8, FLOAT32, SUM, comm, s.cast()),
                            0
                        );
                        assert_eq!(
                            ncclAllReduce(hbuf as _, hbuf as _, 8, BFLOAT16, SUM, comm, s.cast()),
                            0
                        );
                        assert_eq!(
                            ncclAllGather(mine as _, gathered as _, 1, UINT8, comm, s.cast()),
                            0
                        );
                    }
                    sync(s);
                    let f = download(fbuf, 32);
                    let floats = f
                        .chunks(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect();
                    assert_eq!(
                        download(hbuf, 16)[..2],
                        [0x80, 0x40],
                        "bf16 1.0 × 4 ranks = 4.0"
                    );
                    // SAFETY: the communicator is idle.
                    assert_eq!(unsafe { ncclCommDestroy(comm) }, 0);
                    (download(theirs, 64), floats, download(gathered, N))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (ring, sum, gathered)) in results.iter().enumerate() {
        assert_eq!(ring, &vec![((r + N - 1) % N) as u8; 64]);
        let want: Vec<f32> = (0..8).map(|i| (i * (1 + 2 + 3 + 4)) as f32).collect();
        assert_eq!(sum, &want);
        assert_eq!(gathered, &[0, 1, 2, 3]);
    }
}

fn as_bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain numbers viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

#[test]
fn a_truncated_message_aborts_naming_both_ranks() {
    if child().as_deref() == Some("truncated") {
        let c = comms(2);
        let p = on_device(0, &[1; 100]);
        let q = on_device(1, &[0; 100]);
        group(|| {
            send(p, 100, 1, c[0]);
            recv(q, 96, 0, c[1]);
        });
        use_device(1);
        sync(c[1].1);
        return;
    }
    let out = run_child(
        "a_truncated_message_aborts_naming_both_ranks",
        "truncated",
        &[],
    );
    assert_aborts(
        &out,
        &[
            "message truncated",
            "rank 0 to rank 1 sends 100 bytes",
            "receives 96 bytes",
        ],
    );
}

#[test]
fn mismatched_collectives_abort() {
    if child().as_deref() == Some("mismatch") {
        let c = comms(2);
        let p = on_device(0, &[0; 64]);
        let q = on_device(1, &[0; 64]);
        group(|| unsafe {
            ncclAllReduce(p as _, p as _, 4, FLOAT32, SUM, c[0].0, c[0].1.cast());
            ncclAllReduce(q as _, q as _, 8, FLOAT32, SUM, c[1].0, c[1].1.cast());
        });
        use_device(1);
        sync(c[1].1);
        return;
    }
    let out = run_child("mismatched_collectives_abort", "mismatch", &[]);
    assert_aborts(&out, &["collective mismatch", "count 4", "count 8"]);
}

#[test]
fn a_communicator_used_from_two_threads_at_once_aborts() {
    if child().as_deref() == Some("concurrent") {
        let c = comms(2);
        let p = on_device(0, &[0; 16]);
        let (comm, s) = (c[0].0 as usize, c[0].1 as usize);
        // SAFETY: this thread's group stays open while another thread posts to the same comm.
        unsafe { ncclGroupStart() };
        send(p, 16, 1, c[0]);
        std::thread::spawn(move || send(p, 16, 1, (comm as Comm, s as CUstream)))
            .join()
            .ok();
        return;
    }
    let out = run_child(
        "a_communicator_used_from_two_threads_at_once_aborts",
        "concurrent",
        &[],
    );
    assert_aborts(&out, &["used concurrently from two threads"]);
}

#[test]
fn a_deadlock_is_reported_with_every_pending_operation() {
    if child().as_deref() == Some("deadlock") {
        let c = comms(2);
        let p = on_device(0, &[0; 16]);
        send(p, 16, 1, c[0]);
        use_device(0);
        sync(c[0].1);
        return;
    }
    let out = run_child(
        "a_deadlock_is_reported_with_every_pending_operation",
        "deadlock",
        &[("NCCL_RESHARD_EMU_DEADLOCK_SECONDS", "1")],
    );
    assert_aborts(
        &out,
        &[
            "deadlock",
            "rank 0: ncclSend",
            "peer 1, 16 bytes",
            "active (its stream reached it)",
        ],
    );
}

/// An ncclConfig_t header (size, magic, version) with `blocking`.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: i32,
    rest: [i32; 23],
}

fn wait_ready(comm: Comm) -> Duration {
    let start = Instant::now();
    loop {
        let mut state = -1;
        // SAFETY: writes one int.
        assert_eq!(unsafe { ncclCommGetAsyncError(comm, &mut state) }, 0);
        match state {
            0 => return start.elapsed(),
            7 => std::thread::sleep(Duration::from_millis(1)),
            other => panic!("async error {other}"),
        }
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn non_blocking_communicators_must_be_polled() {
    let _turn = error_text_lock();
    let mut id = NcclUniqueId { internal: [0; 128] };
    // SAFETY: writes the id.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, 0);
    let mut config = Config {
        size: std::mem::size_of::<Config>(),
        magic: 0xcafe_beef,
        version: 22803,
        blocking: 0,
        rest: [i32::MIN; 23],
    };
    use_device(0);
    let mut comm = std::ptr::null_mut();
    // SAFETY: a one-rank communicator with a non-blocking config.
    unsafe {
        assert_eq!(
            ncclCommInitRankConfig(&mut comm, 1, id, 0, (&mut config as *mut Config).cast()),
            7
        );
        let mut n = 0;
        assert_eq!(ncclCommCount(comm, &mut n), 4, "unusable while in progress");
        assert!(last_error().contains("before the previous operation returned ncclSuccess"));
    }
    wait_ready(comm);
    let s = stream(1);
    let p = on_device(0, &[5; 32]);
    let q = on_device(0, &[0; 32]);
    // SAFETY: balanced group; a non-blocking group end returns ncclInProgress.
    unsafe {
        assert_eq!(ncclGroupStart(), 0);
        assert_eq!(send(p, 32, 0, (comm, s)), 0);
        assert_eq!(recv(q, 32, 0, (comm, s)), 0);
        assert_eq!(ncclGroupEnd(), 7);
    }
    wait_ready(comm);
    sync(s);
    assert_eq!(read(0, q, 32), [5; 32]);
}

#[test]
fn captured_nccl_groups_are_issued_anew_at_every_launch() {
    let c = comms(2);
    let src = on_device(0, &[0; 64]);
    let dst = on_device(1, &[0; 64]);
    // Thread-local captures of both ranks' streams, then one group posting to both.
    for (r, &(_, s)) in c.iter().enumerate() {
        use_device(r as i32);
        // SAFETY: capture of a stream of this thread.
        ck(unsafe { cuStreamBeginCapture_v2(s, 1) }, "begin capture");
    }
    group(|| {
        assert_eq!(send(src, 64, 1, c[0]), 0);
        assert_eq!(recv(dst, 64, 0, c[1]), 0);
    });
    let mut execs = Vec::new();
    for (r, &(_, s)) in c.iter().enumerate() {
        use_device(r as i32);
        let (mut g, mut e) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: ends the capture begun above and instantiates its graph.
        unsafe {
            ck(cuStreamEndCapture(s, &mut g), "end capture");
            ck(cuGraphInstantiateWithFlags(&mut e, g, 0), "instantiate");
        }
        execs.push(e);
    }
    for round in 1..=3u8 {
        use_device(0);
        upload_async(src, &[round; 64], c[0].1);
        for (r, &(_, s)) in c.iter().enumerate() {
            use_device(r as i32);
            // SAFETY: launches the rank's graph on its stream.
            ck(unsafe { cuGraphLaunch(execs[r], s) }, "launch");
        }
        use_device(1);
        sync(c[1].1);
        assert_eq!(read(1, dst, 64), [round; 64]);
    }
}

#[test]
fn one_thread_initializes_every_rank_inside_a_group() {
    const N: usize = 3;
    let mut id = NcclUniqueId { internal: [0; 128] };
    let mut comms = [std::ptr::null_mut(); N];
    // SAFETY: every rank's init inside one group, each with its device current.
    unsafe {
        assert_eq!(ncclGetUniqueId(&mut id), 0);
        assert_eq!(ncclGroupStart(), 0);
        for (r, comm) in comms.iter_mut().enumerate() {
            assert_eq!(cudaSetDevice(r as i32), 0);
            assert_eq!(ncclCommInitRank(comm, N as i32, id, r as i32), 0);
        }
        assert_eq!(ncclGroupEnd(), 0);
    }
    let ranks: Vec<(Comm, CUstream, CUdeviceptr, CUdeviceptr)> = (0..N)
        .map(|r| {
            let mine = on_device(r as i32, &[r as u8 + 1; 8]);
            let theirs = on_device(r as i32, &[0; 8]);
            (comms[r], stream(1), mine, theirs)
        })
        .collect();
    group(|| {
        for (r, &(comm, s, mine, theirs)) in ranks.iter().enumerate() {
            assert_eq!(send(mine, 8, ((r + 1) % N) as i32, (comm, s)), 0);
            assert_eq!(recv(theirs, 8, ((r + N - 1) % N) as i32, (comm, s)), 0);
        }
    });
    for (r, &(_, s, _, theirs)) in ranks.iter().enumerate() {
        use_device(r as i32);
        sync(s);
        assert_eq!(read(r as i32, theirs, 8), [((r + N - 1) % N) as u8 + 1; 8]);
    }
}

#[test]
fn an_init_whose_ranks_never_all_join_is_reported() {
    if child().as_deref() == Some("init-deadlock") {
        let mut id = NcclUniqueId { internal: [0; 128] };
        let mut comm = std::ptr::null_mut();
        // SAFETY: rank 0 of 2 joins alone and waits.
        unsafe {
            assert_eq!(ncclGetUniqueId(&mut id), 0);
            ncclCommInitRank(&mut comm, 2, id, 0);
        }
        return;
    }
    let out = run_child(
        "an_init_whose_ranks_never_all_join_is_reported",
        "init-deadlock",
        &[("NCCL_RESHARD_EMU_DEADLOCK_SECONDS", "1")],
    );
    assert_aborts(
        &out,
        &[
            "deadlock",
            "ncclCommInit of rank 0",
            "waiting for rank(s) [1] to join",
        ],
    );
}

/// Memory from a stream-ordered pool of device `d`, holding `bytes`, with its pool's access
/// granted to the devices in `grant`.
fn from_pool(d: i32, bytes: &[u8], grant: &[i32]) -> CUdeviceptr {
    use_device(d);
    let s = stream(1);
    let mut pool = std::ptr::null_mut();
    let mut p = 0;
    // SAFETY: a pool on device d, descriptors of valid devices, an allocation in stream order.
    unsafe {
        let mut props: cudarc::driver::sys::CUmemPoolProps = std::mem::zeroed();
        props.allocType = cudarc::driver::sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = cudarc::driver::sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = d;
        ck(cuMemPoolCreate(&mut pool, &props), "cuMemPoolCreate");
        for &peer in grant {
            let mut desc: cudarc::driver::sys::CUmemAccessDesc = std::mem::zeroed();
            desc.location.type_ =
                cudarc::driver::sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = peer;
            desc.flags = cudarc::driver::sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            ck(cuMemPoolSetAccess(pool, &desc, 1), "cuMemPoolSetAccess");
        }
        ck(
            cuMemAllocFromPoolAsync(&mut p, bytes.len(), pool, s),
            "cuMemAllocFromPoolAsync",
        );
    }
    upload_async(p, bytes, s);
    sync(s);
    p
}

#[test]
fn pool_memory_crosses_gpus_only_when_its_pool_grants_the_peer() {
    // Device 2's pool grants device 3: a send from it to a rank on device 3 lands.
    let c = comms(4);
    let data: Vec<u8> = (0..64).collect();
    let granted = from_pool(2, &data, &[3]);
    let into = on_device(3, &[0; 64]);
    group(|| {
        assert_eq!(send(granted, 64, 3, c[2]), 0);
        assert_eq!(recv(into, 64, 2, c[3]), 0);
    });
    use_device(3);
    sync(c[3].1);
    assert_eq!(read(3, into, 64), data);
    if child().as_deref() == Some("ungranted") {
        // The same pool memory received by device 1, which its pool never granted.
        let other = on_device(1, &[0; 64]);
        group(|| {
            send(granted, 64, 1, c[2]);
            recv(other, 64, 2, c[1]);
        });
        use_device(1);
        sync(c[1].1);
        return;
    }
    let out = run_child(
        "pool_memory_crosses_gpus_only_when_its_pool_grants_the_peer",
        "ungranted",
        &[],
    );
    assert_aborts(
        &out,
        &[
            "sendbuff of rank 2",
            "stream-ordered memory pool of device 2",
            "device 1 was not granted access",
        ],
    );
}
