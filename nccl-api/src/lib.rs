//! What the two test doubles of NCCL share, so they answer alike where NCCL's API says how:
//! emu/'s emulated NCCL and loopback/'s stand-in that runs ranks on one GPU. nccl.h's result
//! codes and their texts, the process-wide last-error text, datatypes and their sizes, the
//! `blocking` field of an `ncclConfig_t`, unique ids (and those shrinks derive), and the checks of
//! the arguments of `ncclCommInitRank`, `ncclCommShrink` and `ncclCommGrow`, and the thread's
//! group depth where NCCL keeps it. Plain Rust and one C variable, no CUDA; never linked into
//! libncclreshard.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// `ncclResult_t` values (nccl.h).
pub type NcclResult = i32;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;
pub const TIMEOUT: NcclResult = 8;

/// An NCCL call's failure: its result and the text `ncclGetLastError` returns.
#[derive(Debug)]
pub struct NcclError {
    pub result: NcclResult,
    pub message: String,
}

pub type NResult<T> = Result<T, NcclError>;

pub fn fail<T>(result: NcclResult, message: impl Into<String>) -> NResult<T> {
    Err(NcclError {
        result,
        message: message.into(),
    })
}

/// `ncclGetErrorString` texts (NCCL's).
pub fn error_string(result: NcclResult) -> &'static CStr {
    match result {
        SUCCESS => c"no error",
        UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        INTERNAL_ERROR => c"internal error - please report this issue to the NCCL developers",
        INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        TIMEOUT => c"timeout",
        _ => c"unknown result code",
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// NCCL keeps its last warning in one process-wide buffer; so do its doubles (one per library
/// that links this crate).
static LAST_ERROR: Mutex<[u8; 1024]> = Mutex::new([0; 1024]);

pub fn set_last_error(message: &str) {
    let mut buf = lock(&LAST_ERROR);
    let n = message.len().min(buf.len() - 1);
    buf[..n].copy_from_slice(&message.as_bytes()[..n]);
    buf[n] = 0;
}

/// The buffer's address: static storage, valid for the process's life (its text changes with
/// the next error, as NCCL's does).
pub fn last_error() -> *const c_char {
    lock(&LAST_ERROR).as_ptr().cast()
}

/// `ncclDataType_t` values (nccl.h).
pub mod dtype {
    pub const INT8: i32 = 0;
    pub const UINT8: i32 = 1;
    pub const INT32: i32 = 2;
    pub const UINT32: i32 = 3;
    pub const INT64: i32 = 4;
    pub const UINT64: i32 = 5;
    pub const FLOAT16: i32 = 6;
    pub const FLOAT32: i32 = 7;
    pub const FLOAT64: i32 = 8;
    pub const BFLOAT16: i32 = 9;
    pub const FLOAT8E4M3: i32 = 10;
    pub const FLOAT8E5M2: i32 = 11;

    /// Bytes per element, None for an invalid type.
    pub fn size_of(dtype: i32) -> Option<u64> {
        Some(match dtype {
            INT8 | UINT8 | FLOAT8E4M3 | FLOAT8E5M2 => 1,
            FLOAT16 | BFLOAT16 => 2,
            INT32 | UINT32 | FLOAT32 => 4,
            INT64 | UINT64 | FLOAT64 => 8,
            _ => return None,
        })
    }
}

/// `blocking` of an `ncclConfig_t` (NULL: blocking), reading only what its size and version say
/// it has, as NCCL does.
///
/// # Safety
/// `config` is NULL or points at an `ncclConfig_t` (at least its 16-byte header, and the fields
/// its `size` covers).
pub unsafe fn config_blocking(config: *const c_void) -> NResult<bool> {
    if config.is_null() {
        return Ok(true);
    }
    // SAFETY: the header (size_t size; unsigned magic; unsigned version) is always there.
    let (size, magic, version) = unsafe {
        (
            std::ptr::read_unaligned(config.cast::<usize>()),
            std::ptr::read_unaligned(config.cast::<u8>().add(8).cast::<u32>()),
            std::ptr::read_unaligned(config.cast::<u8>().add(12).cast::<u32>()),
        )
    };
    if magic != 0xcafe_beef {
        return fail(
            INVALID_ARGUMENT,
            "ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER",
        );
    }
    // `blocking` is the int after the 16-byte header; older configs predate it.
    if size < 20 || version < 21400 {
        return Ok(true);
    }
    // SAFETY: `size` says the int after the header is there.
    match unsafe { std::ptr::read_unaligned(config.cast::<u8>().add(16).cast::<i32>()) } {
        0 => Ok(false),
        1 | i32::MIN => Ok(true),
        v => fail(
            INVALID_ARGUMENT,
            format!("Invalid config blocking attribute value {v}"),
        ),
    }
}

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;
pub type UniqueId = [u8; UNIQUE_ID_BYTES];

/// A fresh unique id: the double's 8-byte mark, a process-unique number and this process's
/// id, so ids never collide.
pub fn new_unique_id(mark: &[u8; 8]) -> UniqueId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut id = [0u8; UNIQUE_ID_BYTES];
    id[..8].copy_from_slice(mark);
    id[8..16].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    id[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    id
}

/// The id of a shrink of a clique (by its number on the calling rank and its exclusion list):
/// the same on every survivor that derives it from the same inputs, unlike any other id.
pub fn derived_id(mark: &[u8; 8], parent: &UniqueId, seq: u64, list: &[i32]) -> UniqueId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        h ^= x;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    parent.iter().for_each(|&b| eat(u64::from(b)));
    eat(seq);
    list.iter().for_each(|&r| eat(r as u64));
    let mut id = [0u8; UNIQUE_ID_BYTES];
    id[..8].copy_from_slice(mark);
    id[8..16].copy_from_slice(&h.to_le_bytes());
    id[16..24].copy_from_slice(b"shrunk\0\0");
    id[24..32].copy_from_slice(&seq.to_le_bytes());
    id
}

/// `ncclCommInitRank`'s rank and size.
pub fn check_rank(rank: i32, nranks: i32) -> NResult<()> {
    if nranks < 1 || rank < 0 || rank >= nranks {
        return fail(
            INVALID_ARGUMENT,
            format!("rank {rank} / nranks {nranks}: rank must be in [0, nranks)"),
        );
    }
    Ok(())
}

/// `ncclCommShrink`'s flags: `NCCL_SHRINK_ABORT` (true) or `NCCL_SHRINK_DEFAULT` (false).
pub fn shrink_abort(flags: i32) -> NResult<bool> {
    match flags {
        0 => Ok(false),
        1 => Ok(true),
        _ => fail(
            INVALID_ARGUMENT,
            format!("shrinkFlags is {flags}; use NCCL_SHRINK_DEFAULT (0) or NCCL_SHRINK_ABORT (1)"),
        ),
    }
}

/// NCCL pairs a rank's sends to itself with its receives from itself within one group and
/// refuses a group where one has no partner ("Trying to recv to self without a matching
/// send", `ncclInvalidUsage`): a self message cannot wait for a later group. `self_op` gives
/// an operation's communicator (any key) and whether it sends, for the group's operations to
/// the caller itself (None for the rest); `describe` names one ("ncclRecv on comm …").
pub fn self_messages_pair_up<T>(
    posted: &[T],
    self_op: impl Fn(&T) -> Option<(usize, bool)>,
    describe: impl Fn(&T) -> String,
) -> NResult<()> {
    // Per communicator: its key, self sends, self receives, its first self operation.
    let mut counts: Vec<(usize, u64, u64, &T)> = Vec::new();
    for p in posted {
        let Some((key, send)) = self_op(p) else {
            continue;
        };
        let at = match counts.iter().position(|c| c.0 == key) {
            Some(at) => at,
            None => {
                counts.push((key, 0, 0, p));
                counts.len() - 1
            }
        };
        if send {
            counts[at].1 += 1;
        } else {
            counts[at].2 += 1;
        }
    }
    match counts.iter().find(|c| c.1 != c.2) {
        None => Ok(()),
        Some(&(_, sends, recvs, p)) => fail(
            INVALID_USAGE,
            format!(
                "{}: the group holds {sends} send(s) to self and {recvs} receive(s) from self; NCCL refuses a self send or receive without its partner in the same group (\"Trying to {} self without a matching {}\")",
                describe(p),
                if sends > recvs { "send to" } else { "recv to" },
                if sends > recvs { "recv" } else { "send" },
            ),
        ),
    }
}

/// `ncclCommShrink`'s exclusion list, sorted, checked against the caller: rank `rank` of
/// `nranks`, `describe` naming its communicator for messages. Returns the list, the caller's
/// rank in the new communicator (survivors keep their order) and its size. As NCCL (since
/// 2.27.3), an empty list (a NULL `excludeRanksList` or a count of 0) is refused: a shrink
/// excludes one rank or more.
pub fn shrink(
    raw: &[i32],
    rank: i32,
    nranks: i32,
    describe: &str,
) -> NResult<(Vec<i32>, i32, i32)> {
    if raw.is_empty() {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "ncclCommShrink on {describe}: excludeRanksCount is 0 (or excludeRanksList NULL); NCCL refuses a shrink that excludes no rank (\"ncclCommShrink : excludeRanksList argument is NULL\")"
            ),
        );
    }
    let mut list = raw.to_vec();
    list.sort_unstable();
    if let Some(&r) = list.iter().find(|&&r| r < 0 || r >= nranks) {
        return fail(
            INVALID_ARGUMENT,
            format!("excluded rank {r} is not a rank of {describe}"),
        );
    }
    if list.windows(2).any(|w| w[0] == w[1]) {
        return fail(INVALID_ARGUMENT, "excludeRanksList names a rank twice");
    }
    if list.binary_search(&rank).is_ok() {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "rank {rank} is in excludeRanksList: only the ranks of the new communicator call ncclCommShrink"
            ),
        );
    }
    let below = list.iter().filter(|&&r| r < rank).count() as i32;
    let size = nranks - list.len() as i32;
    Ok((list, rank - below, size))
}

/// `ncclCommGrow` by a new rank (`comm` NULL): `rank` of `nranks`, after the parent's
/// `parent_nranks`.
pub fn grow_new_rank(rank: i32, nranks: i32, parent_nranks: i32) -> NResult<()> {
    if rank < parent_nranks || rank >= nranks {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "rank {rank}: new ranks take ranks {parent_nranks} to {} (after the parent's)",
                nranks - 1
            ),
        );
    }
    Ok(())
}

/// `ncclCommGrow` by an existing rank: it passes `rank` -1 and a larger `nranks`.
pub fn grow_existing_rank(rank: i32, nranks: i32, parent_nranks: i32) -> NResult<()> {
    if rank != -1 {
        return fail(
            INVALID_ARGUMENT,
            format!("rank is {rank}: existing ranks pass -1 (they keep their rank)"),
        );
    }
    if nranks <= parent_nranks {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "nRanks is {nranks}: a grown communicator has more ranks than its parent's {parent_nranks}"
            ),
        );
    }
    Ok(())
}

extern "C" {
    /// This thread's group depth: an `int ncclGroupDepth` in thread-local storage, hidden but
    /// named in the library's symbol table as in NVIDIA's builds (shim/group_depth.c), so that
    /// libncclreshard reads a double's depth as it reads NCCL's.
    fn ncclReshardEmuGroupDepth() -> *mut std::ffi::c_int;
}

/// The calling thread's NCCL group depth.
pub fn group_depth() -> u32 {
    // SAFETY: this thread's int, valid for the thread's life.
    unsafe { *ncclReshardEmuGroupDepth() as u32 }
}

/// Sets the calling thread's NCCL group depth.
pub fn set_group_depth(depth: u32) {
    // SAFETY: as above; only this thread writes it.
    unsafe { *ncclReshardEmuGroupDepth() = depth as std::ffi::c_int }
}

/// `ncclGroupStart`'s depth rule: this thread's group deepens.
pub fn enter_group() {
    set_group_depth(group_depth() + 1);
}

/// `ncclGroupEnd`'s depth rule: `Ok(true)` when this ends the thread's outermost group (its
/// operations are then issued), `Ok(false)` when an outer group stays open, NCCL's error when
/// no group is open.
pub fn leave_group() -> NResult<bool> {
    match group_depth() {
        0 => fail(INVALID_USAGE, "ncclGroupEnd: not in a group call."),
        depth => {
            set_group_depth(depth - 1);
            Ok(depth == 1)
        }
    }
}

/// What a caught panic says (its `String` or `&str` payload), for the doubles' reports.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_messages_pair_up_within_a_group_per_communicator() {
        // (communicator, send?, to self?)
        let ops = [
            (1, true, true),
            (2, false, true),
            (1, false, true),
            (2, true, false),
        ];
        let check = |ops: &[(usize, bool, bool)]| {
            self_messages_pair_up(
                ops,
                |&(c, s, me)| me.then_some((c, s)),
                |o| format!("op {o:?}"),
            )
        };
        assert!(check(&ops[..1]).is_err());
        assert!(check(&ops[..])
            .unwrap_err()
            .message
            .contains("0 send(s) to self and 1 receive(s)"));
        assert!(check(&[ops[0], ops[2], ops[3]]).is_ok());
        assert!(check(&[]).is_ok());
        let e = check(&ops[..1]).unwrap_err();
        assert_eq!(e.result, INVALID_USAGE);
        assert!(
            e.message
                .contains("Trying to send to self without a matching recv"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_shrink_renumbers_survivors_in_order_and_refuses_bad_lists() {
        assert_eq!(shrink(&[5, 2], 4, 8, "c").unwrap(), (vec![2, 5], 3, 6));
        for (list, why) in [
            (&[][..], "excludes no rank"),
            (&[8][..], "not a rank of c"),
            (&[-1][..], "not a rank of c"),
            (&[1, 1][..], "twice"),
            (&[4][..], "only the ranks of the new communicator"),
        ] {
            let e = shrink(list, 4, 8, "c").unwrap_err();
            assert_eq!(e.result, INVALID_ARGUMENT);
            assert!(e.message.contains(why), "{}", e.message);
        }
    }

    #[test]
    fn derived_ids_agree_on_equal_inputs_only() {
        let parent = new_unique_id(b"TESTTEST");
        let a = derived_id(b"TESTTEST", &parent, 1, &[3]);
        assert_eq!(a, derived_id(b"TESTTEST", &parent, 1, &[3]));
        assert_ne!(a, derived_id(b"TESTTEST", &parent, 2, &[3]));
        assert_ne!(a, derived_id(b"TESTTEST", &parent, 1, &[4]));
        assert_ne!(new_unique_id(b"TESTTEST"), new_unique_id(b"TESTTEST"));
    }

    #[test]
    fn configs_say_blocking_as_nccl_reads_them() {
        let config = |size: usize, magic: u32, version: u32, blocking: i32| {
            let mut c = [0u8; 64];
            c[..8].copy_from_slice(&size.to_le_bytes());
            c[8..12].copy_from_slice(&magic.to_le_bytes());
            c[12..16].copy_from_slice(&version.to_le_bytes());
            c[16..20].copy_from_slice(&blocking.to_le_bytes());
            c
        };
        // SAFETY: 64-byte configs with NCCL's header, or NULL.
        unsafe {
            let read = |c: [u8; 64]| config_blocking(c.as_ptr().cast());
            assert!(config_blocking(std::ptr::null()).unwrap());
            assert!(!read(config(64, 0xcafe_beef, 21800, 0)).unwrap());
            assert!(read(config(64, 0xcafe_beef, 21800, i32::MIN)).unwrap());
            assert!(
                read(config(64, 0xcafe_beef, 21300, 0)).unwrap(),
                "predates blocking"
            );
            assert_eq!(
                read(config(64, 0xbad, 21800, 0)).unwrap_err().result,
                INVALID_ARGUMENT
            );
            assert_eq!(
                read(config(64, 0xcafe_beef, 21800, 2)).unwrap_err().result,
                INVALID_ARGUMENT
            );
        }
    }

    #[test]
    fn grows_take_ranks_after_the_parents() {
        assert!(grow_new_rank(7, 8, 7).is_ok());
        assert!(grow_new_rank(6, 8, 7).is_err());
        assert!(grow_existing_rank(-1, 8, 7).is_ok());
        assert!(grow_existing_rank(0, 8, 7).is_err());
        assert!(grow_existing_rank(-1, 7, 7).is_err());
        assert_eq!(dtype::size_of(dtype::BFLOAT16), Some(2));
        assert_eq!(dtype::size_of(12), None);
        assert_eq!(error_string(99).to_str().unwrap(), "unknown result code");
    }
}
