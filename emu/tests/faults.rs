//! NCCL's fault-tolerance API as the emulator implements it, with the faults it injects:
//! `ncclCommRevoke` ends a rank's in-flight operations and frees its stream, `ncclCommShrink`
//! renumbers the survivors (both flags, the same exclusion list everywhere), `ncclCommGrow`
//! adds ranks at the end through the coordinator's identifier; a stopped rank, a slow rank and a
//! broken link behave as a dead process, a slow one and a network error would; and what NCCL
//! forbids (operations on a revoked communicator, functions the emulated NCCL version lacks)
//! aborts with a report.

mod common;

use common::nccl::*;
use common::*;
use cudarc::driver::sys::CUstream;
use ncclreshard_emu::faults::{
    ncclreshardEmuBreakLink, ncclreshardEmuDelayRank, ncclreshardEmuStopRank,
};
use ncclreshard_emu::*;
use std::time::{Duration, Instant};

const REMOTE_ERROR: i32 = 6;

fn async_error(comm: Comm) -> i32 {
    let mut state = -1;
    // SAFETY: writes one int.
    assert_eq!(unsafe { ncclCommGetAsyncError(comm, &mut state) }, 0);
    state
}

/// Whether the stream has finished everything enqueued on it, within `limit`.
fn drains_within(s: CUstream, limit: Duration) -> bool {
    let start = Instant::now();
    // SAFETY: a stream of the emulator.
    while unsafe { cuStreamQuery(s) } != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// `ncclCommShrink` of `comm` excluding `excluded` with `flags`: its result and the new
/// communicator (NULL unless it succeeded).
fn shrink(comm: Comm, excluded: &[i32], flags: i32) -> (i32, Comm) {
    let mut list = excluded.to_vec();
    let mut new = std::ptr::null_mut();
    // SAFETY: the list holds `excluded.len()` ranks; NCCL writes the new handle.
    let result = unsafe {
        ncclCommShrink(
            comm,
            list.as_mut_ptr(),
            list.len() as i32,
            &mut new,
            std::ptr::null_mut(),
            flags,
        )
    };
    (result, new)
}

#[test]
fn a_revoke_ends_the_pending_operations_and_frees_the_stream() {
    let c = comms(2);
    let got = on_device(0, &[7; 64]);
    // Rank 1 never sends: rank 0's receive waits.
    assert_eq!(recv(got, 64, 1, c[0]), 0);
    use_device(0);
    assert!(!drains_within(c[0].1, Duration::from_millis(100)));
    // SAFETY: rank 0's communicator.
    assert_eq!(unsafe { ncclCommRevoke(c[0].0, 0) }, 0);
    assert!(
        drains_within(c[0].1, Duration::from_secs(5)),
        "stream still blocked"
    );
    assert_eq!(async_error(c[0].0), 0);
    // Nothing arrived; the bytes are as they were.
    assert_eq!(read(0, got, 64), vec![7; 64]);
    // Flags other than NCCL_REVOKE_DEFAULT are refused.
    // SAFETY: as above.
    assert_eq!(unsafe { ncclCommRevoke(c[1].0, 1) }, 4);
    // SAFETY: destroying and aborting are still allowed.
    unsafe {
        assert_eq!(ncclCommDestroy(c[0].0), 0);
        assert_eq!(ncclCommAbort(c[1].0), 0);
    }
}

#[test]
fn an_operation_on_a_revoked_communicator_aborts() {
    if child().as_deref() == Some("after-revoke") {
        let c = comms(2);
        let p = on_device(0, &[0; 8]);
        // SAFETY: rank 0's communicator.
        assert_eq!(unsafe { ncclCommRevoke(c[0].0, 0) }, 0);
        send(p, 8, 1, c[0]);
        return;
    }
    let out = run_child(
        "an_operation_on_a_revoked_communicator_aborts",
        "after-revoke",
        &[],
    );
    assert_aborts(&out, &["ncclSend on", "was revoked", "ncclInvalidUsage"]);
}

#[test]
fn a_shrink_renumbers_the_survivors_in_order() {
    let c = comms(3);
    // Rank 1 is gone; ranks 0 and 2 become 0 and 1.
    let mut new = [std::ptr::null_mut(); 2];
    group(|| {
        for (i, &r) in [0usize, 2].iter().enumerate() {
            let result;
            (result, new[i]) = shrink(c[r].0, &[1], 0);
            assert_eq!(result, 0);
        }
    });
    for (i, &comm) in new.iter().enumerate() {
        let (mut rank, mut count) = (-1, -1);
        // SAFETY: writes one int each.
        unsafe {
            assert_eq!(ncclCommUserRank(comm, &mut rank), 0);
            assert_eq!(ncclCommCount(comm, &mut count), 0);
        }
        assert_eq!((rank, count), (i as i32, 2));
    }
    // The new communicator moves data between the survivors.
    let data: Vec<u8> = (0..32).collect();
    let (p, q) = (on_device(0, &data), on_device(2, &[0; 32]));
    use_device(0);
    let s0 = stream(1);
    use_device(2);
    let s2 = stream(1);
    group(|| {
        assert_eq!(send(p, 32, 1, (new[0], s0)), 0);
        assert_eq!(recv(q, 32, 0, (new[1], s2)), 0);
    });
    use_device(2);
    sync(s2);
    assert_eq!(read(2, q, 32), data);
}

#[test]
fn a_shrink_after_a_failure_aborts_the_parents_operations() {
    let c = comms(2);
    let got = on_device(0, &[0; 16]);
    // Pending forever: rank 1 is gone.
    assert_eq!(recv(got, 16, 1, c[0]), 0);
    let (result, new) = shrink(c[0].0, &[1], 1);
    assert_eq!(result, 0);
    use_device(0);
    assert!(drains_within(c[0].1, Duration::from_secs(5)));
    let mut count = 0;
    // SAFETY: writes one int.
    assert_eq!(unsafe { ncclCommCount(new, &mut count) }, 0);
    assert_eq!(count, 1);
}

#[test]
fn shrink_misuse_aborts() {
    match child().as_deref() {
        Some("outstanding") => {
            let c = comms(2);
            let got = on_device(0, &[0; 16]);
            recv(got, 16, 1, c[0]);
            // NCCL_SHRINK_DEFAULT with an operation pending: refused.
            shrink(c[0].0, &[1], 0);
            return;
        }
        Some("lists") => {
            let c = comms(4);
            // Ranks 0 and 1 disagree on who failed.
            // SAFETY: opens a group (the scenario aborts inside it).
            assert_eq!(unsafe { ncclGroupStart() }, 0);
            shrink(c[0].0, &[3], 0);
            shrink(c[1].0, &[2], 0);
            return;
        }
        _ => {}
    }
    let out = run_child("shrink_misuse_aborts", "outstanding", &[]);
    assert_aborts(
        &out,
        &[
            "ncclCommShrink on",
            "have not completed",
            "NCCL_SHRINK_ABORT",
        ],
    );
    let out = run_child("shrink_misuse_aborts", "lists", &[]);
    assert_aborts(
        &out,
        &[
            "rank 1 excludes [2] but rank 0 excluded [3]",
            "same exclusion list",
        ],
    );
    // A rank in the list may not call it; errors, not aborts.
    let c = comms(2);
    // Rank 0 excludes itself.
    assert_eq!(shrink(c[0].0, &[0], 0).0, 4);
}

#[test]
fn a_grow_adds_new_ranks_after_the_old_ones() {
    let c = comms(2);
    let mut id = NcclUniqueId { internal: [0; 128] };
    // SAFETY: the coordinator (rank 0) makes the grow identifier.
    assert_eq!(unsafe { ncclCommGetUniqueId(c[0].0, &mut id) }, 0);
    // One at a time: a second identifier before the first is consumed is refused.
    let mut second = NcclUniqueId { internal: [0; 128] };
    // SAFETY: as above.
    assert_eq!(unsafe { ncclCommGetUniqueId(c[0].0, &mut second) }, 5);
    let grown: Vec<Comm> = std::thread::scope(|scope| {
        let olds: Vec<_> = (0..2)
            .map(|r| {
                let (comm, id) = (c[r].0 as usize, id);
                scope.spawn(move || {
                    use_device(r as i32);
                    let mut new = std::ptr::null_mut();
                    let uid: *const NcclUniqueId = if r == 0 { &id } else { std::ptr::null() };
                    // SAFETY: existing ranks keep their rank (-1).
                    let result = unsafe {
                        ncclCommGrow(comm as Comm, 4, uid, -1, &mut new, std::ptr::null_mut())
                    };
                    assert_eq!(result, 0);
                    new as usize
                })
            })
            .collect();
        let news: Vec<_> = (2..4)
            .map(|r| {
                scope.spawn(move || {
                    use_device(r);
                    let mut new = std::ptr::null_mut();
                    // SAFETY: new ranks take ranks from the parent's size on.
                    let result = unsafe {
                        ncclCommGrow(
                            std::ptr::null_mut(),
                            4,
                            &id,
                            r,
                            &mut new,
                            std::ptr::null_mut(),
                        )
                    };
                    assert_eq!(result, 0);
                    new as usize
                })
            })
            .collect();
        olds.into_iter()
            .chain(news)
            .map(|h| h.join().unwrap() as Comm)
            .collect()
    });
    for (r, &comm) in grown.iter().enumerate() {
        let (mut rank, mut count) = (-1, -1);
        // SAFETY: writes one int each.
        unsafe {
            assert_eq!(ncclCommUserRank(comm, &mut rank), 0);
            assert_eq!(ncclCommCount(comm, &mut count), 0);
        }
        assert_eq!((rank, count), (r as i32, 4));
    }
    // A new rank sends to an old one over the grown communicator.
    let data: Vec<u8> = (0..16).map(|i| 200 - i).collect();
    let (p, q) = (on_device(3, &data), on_device(0, &[0; 16]));
    use_device(3);
    let s3 = stream(1);
    use_device(0);
    let s0 = stream(1);
    group(|| {
        assert_eq!(send(p, 16, 0, (grown[3], s3)), 0);
        assert_eq!(recv(q, 16, 3, (grown[0], s0)), 0);
    });
    use_device(0);
    sync(s0);
    assert_eq!(read(0, q, 16), data);
    // The identifier was consumed: the coordinator may make the next.
    // SAFETY: as above.
    assert_eq!(unsafe { ncclCommGetUniqueId(grown[0], &mut second) }, 0);
}

#[test]
fn a_stopped_rank_leaves_its_peers_waiting_until_they_revoke() {
    let c = comms(2);
    let data = on_device(0, &[9; 32]);
    let got = on_device(1, &[0; 32]);
    // Rank 0 dies after its first operation of the group: the first send runs, the second
    // never does.
    assert_eq!(ncclreshardEmuStopRank(c[0].0, 1), 0);
    group(|| {
        assert_eq!(send(data, 16, 1, c[0]), 0);
        assert_eq!(send(data, 16, 1, c[0]), 0);
        assert_eq!(recv(got, 16, 0, c[1]), 0);
        assert_eq!(recv(got, 16, 0, c[1]), 0);
    });
    use_device(1);
    assert!(!drains_within(c[1].1, Duration::from_millis(200)));
    // SAFETY: the survivor revokes; the dead rank's state is cleaned up by an abort.
    unsafe {
        assert_eq!(ncclCommRevoke(c[1].0, 0), 0);
        assert!(drains_within(c[1].1, Duration::from_secs(5)));
        assert_eq!(ncclCommAbort(c[0].0), 0);
    }
    use_device(0);
    assert!(drains_within(c[0].1, Duration::from_secs(5)));
}

#[test]
fn a_slow_rank_is_late_but_completes() {
    let c = comms(2);
    let data: Vec<u8> = (0..8).collect();
    let (p, q) = (on_device(0, &data), on_device(1, &[0; 8]));
    assert_eq!(ncclreshardEmuDelayRank(c[0].0, 300), 0);
    let start = Instant::now();
    group(|| {
        assert_eq!(send(p, 8, 1, c[0]), 0);
        assert_eq!(recv(q, 8, 0, c[1]), 0);
    });
    use_device(1);
    sync(c[1].1);
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert_eq!(read(1, q, 8), data);
}

#[test]
fn a_broken_link_reports_a_remote_error_and_never_completes() {
    let c = comms(2);
    let (p, q) = (on_device(0, &[1; 8]), on_device(1, &[0; 8]));
    assert_eq!(ncclreshardEmuBreakLink(c[1].0, 0), 0);
    group(|| {
        assert_eq!(send(p, 8, 1, c[0]), 0);
        assert_eq!(recv(q, 8, 0, c[1]), 0);
    });
    let start = Instant::now();
    while async_error(c[0].0) != REMOTE_ERROR || async_error(c[1].0) != REMOTE_ERROR {
        assert!(start.elapsed() < Duration::from_secs(5), "no async error");
        std::thread::sleep(Duration::from_millis(2));
    }
    use_device(1);
    assert!(!drains_within(c[1].1, Duration::from_millis(100)));
    // SAFETY: both ranks abort.
    unsafe {
        assert_eq!(ncclCommAbort(c[0].0), 0);
        assert_eq!(ncclCommAbort(c[1].0), 0);
    }
    assert!(drains_within(c[1].1, Duration::from_secs(5)));
    assert_eq!(read(1, q, 8), vec![0; 8]);
}

#[test]
fn functions_newer_than_the_emulated_nccl_abort() {
    if child().as_deref() == Some("old-nccl") {
        let c = comms(1);
        // SAFETY: called although NCCL 2.27.0 has no ncclCommRevoke.
        unsafe { ncclCommRevoke(c[0].0, 0) };
        return;
    }
    let out = run_child(
        "functions_newer_than_the_emulated_nccl_abort",
        "old-nccl",
        &[("NCCL_RESHARD_EMU_NCCL_VERSION", "22700")],
    );
    assert_aborts(
        &out,
        &["ncclCommRevoke does not exist in NCCL 22700", "2.28.7"],
    );
}
