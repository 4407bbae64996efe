//! NCCL's C entry points (signatures from nccl.h): the ones libncclreshard and its GPU tests
//! call. Each converts its arguments, calls the stand-in and converts the result; errors set
//! the text `ncclGetLastError` returns and, inside a group, the group's error.

use crate::comm::{self, Comm, UniqueId, UNIQUE_ID_BYTES};
use crate::exchange::{Kind, Posted};
use crate::group;
use crate::report::{
    self, fail, lock, misuse, NResult, NcclError, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS,
    SUCCESS,
};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

/// The NCCL API level the stand-in implements (`ncclGetVersion`): 2.29.7, whose revoke, shrink
/// and grow libncclreshard uses.
pub const NCCL_VERSION_CODE: c_int = 22907;

/// `ncclUniqueId` (passed by value, 128 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    pub internal: UniqueId,
}

pub type NcclComm = *mut c_void;

/// Runs an export: errors set the last-error text (and the open group's error).
fn call(name: &str, body: impl FnOnce() -> NResult<i32>) -> c_int {
    report::boundary(name, || match body() {
        Ok(r) => r,
        Err(e) => {
            report::set_last_error(&e.message);
            group::note_error(e.result, &e.message);
            e.result
        }
    })
}

fn out<T>(ptr: *mut T, what: &str) -> NResult<*mut T> {
    if ptr.is_null() {
        fail(INVALID_ARGUMENT, format!("{what} argument is NULL"))
    } else {
        Ok(ptr)
    }
}

fn comm_of(handle: NcclComm) -> NResult<Arc<Comm>> {
    comm::get(handle as usize)
}

/// Present only in the stand-in: tests find it to know they run on it (N ranks may share a
/// device). Returns 1.
#[no_mangle]
pub extern "C" fn ncclreshardLoopback() -> c_int {
    1
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    call("ncclGetVersion", || {
        // SAFETY: non-NULL (checked); the caller passes a writable int.
        unsafe { *out(version, "version")? = NCCL_VERSION_CODE };
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut NcclUniqueId) -> c_int {
    call("ncclGetUniqueId", || {
        // SAFETY: non-NULL (checked); the caller passes a writable ncclUniqueId.
        unsafe {
            *out(id, "uniqueId")? = NcclUniqueId {
                internal: comm::new_unique_id(),
            }
        };
        Ok(SUCCESS)
    })
}

/// A child communicator's blocking mode: the config's, else (NULL) the parent's.
unsafe fn child_blocking(parent: Option<&Comm>, config: *const c_void) -> NResult<bool> {
    match (parent, config.is_null()) {
        (Some(p), true) => Ok(p.blocking),
        // SAFETY: the caller's contract for `config`.
        _ => unsafe { ncclreshard_nccl_api::config_blocking(config) },
    }
}

fn refuse_in_group(what: &str) -> NResult<()> {
    if group::depth() > 0 {
        return misuse(
            INVALID_USAGE,
            format!("{what} inside ncclGroupStart/ncclGroupEnd: the loopback stand-in makes communicators outside groups only"),
        );
    }
    Ok(())
}

fn init_rank(
    comm_out: *mut NcclComm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    blocking: bool,
) -> NResult<i32> {
    refuse_in_group("ncclCommInitRank")?;
    let c = comm::join(id.internal, nranks, rank, blocking)?;
    // SAFETY: checked non-NULL by the callers.
    unsafe { *comm_out = c.handle as NcclComm };
    comm::complete_init(c, || {})
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut NcclComm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    call("ncclCommInitRank", || {
        init_rank(out(comm, "comm")?, nranks, id, rank, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut NcclComm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    config: *mut c_void,
) -> c_int {
    call("ncclCommInitRankConfig", || {
        // SAFETY: the caller's contract (nccl.h): NULL or an ncclConfig_t.
        let blocking = unsafe { ncclreshard_nccl_api::config_blocking(config)? };
        init_rank(out(comm, "comm")?, nranks, id, rank, blocking)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: NcclComm) -> c_int {
    call("ncclCommDestroy", || {
        if comm.is_null() {
            return Ok(SUCCESS);
        }
        let c = comm_of(comm)?;
        // As NCCL's destroy finalizes first: the rank's operations complete (the watchdog
        // speaks if they never do). A revoked communicator has nothing left to flush.
        if !c.is_revoked() {
            while !c.pending().is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        comm::unregister(c.handle);
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: NcclComm) -> c_int {
    call("ncclCommAbort", || {
        if comm.is_null() {
            return Ok(SUCCESS);
        }
        let c = comm_of(comm)?;
        comm::revoke(&c);
        comm::unregister(c.handle);
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: NcclComm, revoke_flags: c_int) -> c_int {
    call("ncclCommRevoke", || {
        let c = comm_of(comm)?;
        if revoke_flags != 0 {
            return misuse(
                INVALID_ARGUMENT,
                format!("revokeFlags is {revoke_flags}; it must be NCCL_REVOKE_DEFAULT (0)"),
            );
        }
        comm::revoke(&c);
        if c.blocking {
            return Ok(SUCCESS);
        }
        // Quiescent once its operations are over (matched ones need their peers' streams).
        c.set_async(IN_PROGRESS);
        std::thread::spawn(move || {
            while !c.pending().is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            c.set_async(SUCCESS);
        });
        Ok(IN_PROGRESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: NcclComm,
    exclude_ranks: *mut c_int,
    exclude_count: c_int,
    newcomm: *mut NcclComm,
    config: *mut c_void,
    shrink_flags: c_int,
) -> c_int {
    call("ncclCommShrink", || {
        refuse_in_group("ncclCommShrink")?;
        let c = comm_of(comm)?;
        let newcomm = out(newcomm, "newcomm")?;
        let abort = ncclreshard_nccl_api::shrink_abort(shrink_flags)?;
        let count = usize::try_from(exclude_count).map_err(|_| NcclError {
            result: INVALID_ARGUMENT,
            message: format!("excludeRanksCount is {exclude_count}"),
        })?;
        let raw: &[i32] = if count == 0 {
            &[]
        } else {
            // SAFETY: the caller passes `count` ints (nccl.h).
            unsafe { std::slice::from_raw_parts(out(exclude_ranks, "excludeRanksList")?, count) }
        };
        let (list, rank, nranks) =
            ncclreshard_nccl_api::shrink(raw, c.rank, c.nranks, &c.describe())?;
        if abort {
            comm::revoke(&c);
        } else {
            c.require_idle("ncclCommShrink")?;
        }
        // SAFETY: the caller's contract (nccl.h): NULL or an ncclConfig_t.
        let blocking = unsafe { child_blocking(Some(&c), config)? };
        let seq = {
            let mut n = lock(&c.shrinks);
            *n += 1;
            *n
        };
        {
            let mut shrinks = lock(&c.clique.shrinks);
            match shrinks.get(&seq) {
                Some((theirs, first)) if *theirs != list => report::fatal(format_args!(
                    "ncclCommShrink #{seq} of clique {}: rank {} excludes {list:?} but rank {first} excluded {theirs:?}; every surviving rank must pass the same exclusion list",
                    c.clique.serial, c.rank
                )),
                Some(_) => {}
                None => {
                    shrinks.insert(seq, (list.clone(), c.rank));
                }
            }
        }
        let id = comm::derived_id(&c.clique.id, seq, &list);
        let child = {
            let d = crate::cuda::driver()?;
            let _current = d.push(c.context)?;
            comm::join(id, nranks, rank, blocking)?
        };
        // SAFETY: checked non-NULL above.
        unsafe { *newcomm = child.handle as NcclComm };
        comm::complete_init(child, || {})
    })
}

/// Grow identifiers not consumed yet: id → the parent's size.
fn grow_parents() -> &'static Mutex<HashMap<UniqueId, i32>> {
    static G: OnceLock<Mutex<HashMap<UniqueId, i32>>> = OnceLock::new();
    G.get_or_init(Default::default)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetUniqueId(
    comm: NcclComm,
    unique_id: *mut NcclUniqueId,
) -> c_int {
    call("ncclCommGetUniqueId", || {
        let c = comm_of(comm)?;
        let unique_id = out(unique_id, "uniqueId")?;
        c.require_idle("ncclCommGetUniqueId")?;
        let mut pending = lock(&c.clique.grow_id);
        if pending.is_some() {
            return misuse(
                INVALID_USAGE,
                "a grow identifier of this communicator has not been consumed yet (one grow at a time)",
            );
        }
        let id = comm::new_unique_id();
        *pending = Some(id);
        c.clique.grow_ready.notify_all();
        lock(grow_parents()).insert(id, c.nranks);
        // SAFETY: non-NULL (checked); the caller passes a writable ncclUniqueId.
        unsafe { *unique_id = NcclUniqueId { internal: id } };
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGrow(
    comm: NcclComm,
    nranks: c_int,
    unique_id: *const NcclUniqueId,
    rank: c_int,
    newcomm: *mut NcclComm,
    config: *mut c_void,
) -> c_int {
    call("ncclCommGrow", || {
        refuse_in_group("ncclCommGrow")?;
        let newcomm = out(newcomm, "newcomm")?;
        // SAFETY: NULL or the caller's ncclUniqueId (nccl.h).
        let given = unsafe { unique_id.as_ref() }.map(|u| u.internal);
        if comm.is_null() {
            // A new rank: the coordinator's identifier and a rank from the parent's size on.
            let Some(id) = given else {
                return misuse(
                    INVALID_ARGUMENT,
                    "a new rank (comm NULL) needs the uniqueId the coordinator got from ncclCommGetUniqueId",
                );
            };
            let Some(parent) = lock(grow_parents()).get(&id).copied() else {
                return misuse(
                    INVALID_ARGUMENT,
                    "uniqueId is not an unconsumed grow identifier from ncclCommGetUniqueId",
                );
            };
            ncclreshard_nccl_api::grow_new_rank(rank, nranks, parent)?;
            // SAFETY: the caller's contract (nccl.h): NULL or an ncclConfig_t.
            let blocking = unsafe { child_blocking(None, config)? };
            let child = comm::join(id, nranks, rank, blocking)?;
            // SAFETY: checked non-NULL above.
            unsafe { *newcomm = child.handle as NcclComm };
            return comm::complete_init(child, || {});
        }
        let c = comm_of(comm)?;
        ncclreshard_nccl_api::grow_existing_rank(rank, nranks, c.nranks)?;
        c.require_idle("ncclCommGrow")?;
        // The coordinator names the identifier; the others learn it from the clique (NCCL
        // coordinates internally): they wait for it.
        let id = {
            let mut pending = lock(&c.clique.grow_id);
            if let Some(given) = given {
                if *pending != Some(given) {
                    return misuse(
                        INVALID_ARGUMENT,
                        "uniqueId is not the grow identifier ncclCommGetUniqueId made for this communicator",
                    );
                }
            }
            let _waiting = crate::watchdog::blocked_init(&c.clique, c.rank);
            while pending.is_none() {
                pending = c
                    .clique
                    .grow_ready
                    .wait(pending)
                    .unwrap_or_else(|p| p.into_inner());
            }
            pending.expect("set")
        };
        // SAFETY: the caller's contract (nccl.h): NULL or an ncclConfig_t.
        let blocking = unsafe { child_blocking(Some(&c), config)? };
        let child = {
            let d = crate::cuda::driver()?;
            let _current = d.push(c.context)?;
            comm::join(id, nranks, c.rank, blocking)?
        };
        // SAFETY: checked non-NULL above.
        unsafe { *newcomm = child.handle as NcclComm };
        // The identifier is consumed once every rank has joined.
        let clique = c.clique.clone();
        comm::complete_init(child, move || {
            let mut pending = lock(&clique.grow_id);
            if *pending == Some(id) {
                *pending = None;
            }
            lock(grow_parents()).remove(&id);
        })
    })
}

unsafe fn comm_int(
    name: &str,
    comm: NcclComm,
    value: *mut c_int,
    f: impl FnOnce(&Comm) -> i32,
) -> c_int {
    call(name, || {
        let c = comm_of(comm)?;
        let value = out(value, "value")?;
        c.ensure_ready()?;
        // SAFETY: non-NULL (checked); the caller passes a writable int.
        unsafe { *value = f(&c) };
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: NcclComm, count: *mut c_int) -> c_int {
    // SAFETY: forwards the caller's pointers.
    unsafe { comm_int("ncclCommCount", comm, count, |c| c.nranks) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: NcclComm, rank: *mut c_int) -> c_int {
    // SAFETY: forwards the caller's pointers.
    unsafe { comm_int("ncclCommUserRank", comm, rank, |c| c.rank) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: NcclComm, device: *mut c_int) -> c_int {
    // SAFETY: forwards the caller's pointers.
    unsafe { comm_int("ncclCommCuDevice", comm, device, |c| c.device) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: NcclComm, result: *mut c_int) -> c_int {
    call("ncclCommGetAsyncError", || {
        let c = comm_of(comm)?;
        let state = lock(&c.status).async_error;
        // SAFETY: non-NULL (checked); the caller passes a writable ncclResult_t.
        unsafe { *out(result, "asyncError")? = state };
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    report::boundary("ncclGetErrorString", || {
        report::error_string(result).as_ptr()
    })
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: NcclComm) -> *const c_char {
    report::boundary("ncclGetLastError", report::last_error)
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> c_int {
    call("ncclGroupStart", || {
        group::start();
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> c_int {
    report::boundary("ncclGroupEnd", || match group::end() {
        Ok(r) => r,
        Err(e) => {
            report::set_last_error(&e.message);
            e.result
        }
    })
}

/// Checks and posts a send or receive.
fn post(
    kind: Kind,
    buf: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> NResult<i32> {
    let c = comm_of(comm)?;
    let Some(size) = ncclreshard_nccl_api::dtype::size_of(datatype) else {
        return misuse(
            INVALID_ARGUMENT,
            format!("{}: invalid datatype {datatype}", kind.name()),
        );
    };
    if peer < 0 || peer >= c.nranks {
        return misuse(
            INVALID_ARGUMENT,
            format!(
                "{} on {}: peer {peer} is out of range for a communicator of {} ranks",
                kind.name(),
                c.describe(),
                c.nranks
            ),
        );
    }
    if c.is_revoked() {
        return misuse(
            INVALID_USAGE,
            format!(
                "{} on {}: the communicator was revoked (ncclCommRevoke); NCCL returns ncclInvalidUsage for new operations on it and allows only ncclCommDestroy, ncclCommAbort and ncclCommShrink",
                kind.name(),
                c.describe()
            ),
        );
    }
    c.ensure_ready()?;
    let bytes = (count as u64).checked_mul(size).ok_or_else(|| NcclError {
        result: INVALID_ARGUMENT,
        message: format!("{}: count {count} overflows", kind.name()),
    })?;
    if bytes > 0 && buf.is_null() {
        return misuse(
            INVALID_ARGUMENT,
            format!(
                "{} on {}: buffer is NULL for {bytes} bytes",
                kind.name(),
                c.describe()
            ),
        );
    }
    // The stream must be one of the communicator's context (its device), as NCCL requires.
    let d = crate::cuda::driver()?;
    let owner = {
        let _current = d.push(c.context)?;
        d.stream_context(stream as usize)?
    };
    if owner != c.context {
        return misuse(
            INVALID_ARGUMENT,
            format!(
                "{} on {}: stream {stream:p} belongs to another CUDA context than the communicator's (the one current when the rank joined, device {})",
                kind.name(),
                c.describe(),
                c.device
            ),
        );
    }
    group::post(Posted {
        comm: c,
        kind,
        ptr: buf as u64,
        bytes,
        peer,
        stream: stream as usize,
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> c_int {
    call("ncclSend", || {
        post(Kind::Send, sendbuff, count, datatype, peer, comm, stream)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> c_int {
    call("ncclRecv", || {
        post(Kind::Recv, recvbuff, count, datatype, peer, comm, stream)
    })
}

/// Refused: the stand-in moves bytes with copies and has no reduction of its own (a kernel
/// would not run on the emulator, which runs only libncclreshard's copy kernel).
#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    _sendbuff: *const c_void,
    _recvbuff: *mut c_void,
    _count: usize,
    _datatype: c_int,
    _op: c_int,
    comm: NcclComm,
    _stream: *mut c_void,
) -> c_int {
    call("ncclAllReduce", || {
        let c = comm_of(comm)?;
        misuse(
            INVALID_USAGE,
            format!(
                "ncclAllReduce on {}: the loopback stand-in implements point-to-point operations only (ncclSend/ncclRecv), no collectives",
                c.describe()
            ),
        )
    })
}

const _: () = assert!(std::mem::size_of::<NcclUniqueId>() == UNIQUE_ID_BYTES);
