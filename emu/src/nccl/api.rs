//! NCCL's C entry points (signatures from nccl.h).

use super::comm::{self, UNIQUE_ID_BYTES};
use super::group;
use super::ops::OpKind;
use super::reduce;
use super::{fail, NResult, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, SUCCESS};
use crate::config::config;
use crate::diag;
use crate::handles::lock;
use ncclreshard_nccl_api::config_blocking;
use std::ffi::{c_char, c_int, c_void};

/// `ncclUniqueId` (passed by value, 128 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    pub internal: [u8; UNIQUE_ID_BYTES],
}

pub type NcclComm = *mut c_void;

/// Runs an NCCL export: errors set the last-error text (and the open group's error).
fn call(name: &str, body: impl FnOnce() -> NResult<i32>) -> c_int {
    diag::boundary(name, || match body() {
        Ok(r) => r,
        Err(e) => {
            super::set_last_error(&e.message);
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

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    call("ncclGetVersion", || {
        *out(version, "version")? = config().nccl_version;
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut NcclUniqueId) -> c_int {
    call("ncclGetUniqueId", || {
        *out(id, "uniqueId")? = NcclUniqueId {
            internal: comm::new_unique_id(),
        };
        Ok(SUCCESS)
    })
}

fn init_rank(
    comm_out: *mut NcclComm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    blocking: bool,
) -> NResult<i32> {
    let device = comm::calling_device();
    let c = comm::join(id.internal, nranks, rank, device, blocking)?;
    // SAFETY: checked non-NULL by the callers.
    unsafe { *comm_out = c.handle as NcclComm };
    complete_init(c, "ncclCommInitRank", || {})
}

/// Completes a joined communicator's init as NCCL does: at the open group's end, now
/// (blocking), or on a helper thread (non-blocking, `ncclInProgress`). `then` runs once the
/// clique is complete.
fn complete_init(
    c: std::sync::Arc<comm::Comm>,
    what: &'static str,
    then: impl FnOnce() + Send + 'static,
) -> NResult<i32> {
    if group::depth() > 0 {
        group::defer_init(c);
        then();
        return Ok(SUCCESS);
    }
    if c.blocking {
        comm::finish_init(&c);
        then();
        return Ok(SUCCESS);
    }
    let delay = config().nonblocking_delay;
    std::thread::spawn(move || {
        diag::boundary(what, || {
            c.clique.wait_complete(&c);
            std::thread::sleep(delay);
            then();
            c.set_async(SUCCESS);
        })
    });
    Ok(IN_PROGRESS)
}

/// A function NCCL added in version `since` (`ncclGetVersion` form): calling it while the
/// emulated NCCL is older is a call of a symbol that would not exist.
fn requires(name: &str, since: i32) -> NResult<()> {
    let version = config().nccl_version;
    if version < since {
        diag::fatal(format_args!(
            "{name} does not exist in NCCL {version} (NCCL_RESHARD_EMU_NCCL_VERSION): it came with NCCL {}.{}.{}; a caller must check for the symbol or the version first",
            since / 10000,
            since / 100 % 100,
            since % 100
        ));
    }
    Ok(())
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
        let blocking = config_blocking(config)?;
        init_rank(out(comm, "comm")?, nranks, id, rank, blocking)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut NcclComm,
    ndev: c_int,
    devlist: *const c_int,
) -> c_int {
    call("ncclCommInitAll", || {
        out(comms, "comms")?;
        if ndev < 1 {
            return fail(INVALID_ARGUMENT, format!("invalid ndev {ndev}"));
        }
        let id = comm::new_unique_id();
        let mut made = Vec::new();
        for r in 0..ndev {
            let device = if devlist.is_null() {
                r
            } else {
                *devlist.add(r as usize)
            };
            let c = comm::join(id, ndev, r, device, true)?;
            *comms.add(r as usize) = c.handle as NcclComm;
            made.push(c);
        }
        for c in &made {
            comm::finish_init(c);
        }
        Ok(SUCCESS)
    })
}

fn comm_of(handle: NcclComm) -> NResult<std::sync::Arc<comm::Comm>> {
    comm::get(handle as usize)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: NcclComm) -> c_int {
    call("ncclCommFinalize", || {
        let c = comm_of(comm)?;
        if lock(&c.status).revoked {
            let message = format!(
                "ncclCommFinalize on {}: the communicator was revoked; NCCL does not support finalizing it (destroy or shrink it)",
                c.describe()
            );
            return Err(diag::strict(
                message.clone(),
                super::NcclError {
                    result: INVALID_USAGE,
                    message,
                },
            ));
        }
        c.ensure_ready()?;
        lock(&c.status).finalized = true;
        if c.blocking {
            c.wait_outstanding();
            return Ok(SUCCESS);
        }
        c.set_async(IN_PROGRESS);
        std::thread::spawn(move || {
            c.wait_outstanding();
            c.set_async(SUCCESS);
        });
        Ok(IN_PROGRESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: NcclComm) -> c_int {
    call("ncclCommDestroy", || {
        if comm.is_null() {
            return Ok(SUCCESS);
        }
        let c = comm_of(comm)?;
        if !lock(&c.status).aborted {
            c.wait_outstanding();
        }
        comm::registry().remove(c.handle);
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
        lock(&c.status).aborted = true;
        super::ops::abandon(&c);
        lock(&c.outstanding).clear();
        comm::registry().remove(c.handle);
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: NcclComm, revoke_flags: c_int) -> c_int {
    call("ncclCommRevoke", || {
        requires("ncclCommRevoke", 22807)?;
        let c = comm_of(comm)?;
        if revoke_flags != 0 {
            return fail(
                INVALID_ARGUMENT,
                format!("revokeFlags is {revoke_flags}; it must be NCCL_REVOKE_DEFAULT (0)"),
            );
        }
        {
            let mut st = lock(&c.status);
            if st.aborted {
                return fail(INVALID_USAGE, "communicator was aborted");
            }
            st.revoked = true;
        }
        // In-flight operations stop; the communicator is quiescent once they have.
        super::ops::abandon(&c);
        if c.blocking {
            c.set_async(SUCCESS);
            return Ok(SUCCESS);
        }
        c.set_async(IN_PROGRESS);
        let delay = config().nonblocking_delay;
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            c.set_async(SUCCESS);
        });
        Ok(IN_PROGRESS)
    })
}

/// `ncclConfig_t`'s blocking flag for a communicator made from `parent` (NULL: the parent's).
unsafe fn child_blocking(parent: Option<&comm::Comm>, config: *const c_void) -> NResult<bool> {
    match (parent, config.is_null()) {
        (Some(p), true) => Ok(p.blocking),
        _ => config_blocking(config),
    }
}

/// A parent that must be idle (`NCCL_SHRINK_DEFAULT`, grow): NCCL may deadlock otherwise.
fn require_idle(c: &comm::Comm, what: &str) -> NResult<()> {
    if !c.has_outstanding() {
        return Ok(());
    }
    let message = format!(
        "{what} on {}: the communicator has operations that have not completed; NCCL requires none (it may deadlock){}",
        c.describe(),
        if what == "ncclCommShrink" {
            "; shrink with NCCL_SHRINK_ABORT after a failure"
        } else {
            ""
        }
    );
    Err(diag::strict(
        message.clone(),
        super::NcclError {
            result: INVALID_USAGE,
            message,
        },
    ))
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
        requires("ncclCommShrink", 22703)?;
        let c = comm_of(comm)?;
        let newcomm = out(newcomm, "newcomm")?;
        let abort = ncclreshard_nccl_api::shrink_abort(shrink_flags)?;
        let count = usize::try_from(exclude_count).map_err(|_| super::NcclError {
            result: INVALID_ARGUMENT,
            message: format!("excludeRanksCount is {exclude_count}"),
        })?;
        let raw: &[i32] = if count == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(out(exclude_ranks, "excludeRanksList")?, count)
        };
        let (list, rank, nranks) =
            ncclreshard_nccl_api::shrink(raw, c.rank, c.nranks, &c.describe())?;
        if lock(&c.status).aborted {
            return fail(INVALID_USAGE, "communicator was aborted");
        }
        if abort {
            super::ops::abandon(&c);
        } else {
            require_idle(&c, "ncclCommShrink")?;
        }
        let blocking = child_blocking(Some(&c), config)?;
        let seq = {
            let mut n = lock(&c.shrinks);
            *n += 1;
            *n
        };
        {
            let mut shrinks = lock(&c.clique.shrinks);
            match shrinks.get(&seq) {
                Some((theirs, first)) if *theirs != list => diag::fatal(format_args!(
                    "ncclCommShrink #{seq} of the communicator's clique: rank {} excludes {list:?} but rank {first} excluded {theirs:?}; every surviving rank must pass the same exclusion list",
                    c.rank
                )),
                Some(_) => {}
                None => {
                    shrinks.insert(seq, (list.clone(), c.rank));
                }
            }
        }
        let id = comm::derived_id(&c.clique.id, seq, &list);
        let child = comm::join(id, nranks, rank, c.device, blocking)?;
        *newcomm = child.handle as NcclComm;
        complete_init(child, "non-blocking ncclCommShrink", || {})
    })
}

/// Grow identifiers not consumed yet: id → the parent's size.
fn grow_parents() -> &'static std::sync::Mutex<std::collections::HashMap<[u8; UNIQUE_ID_BYTES], i32>>
{
    static G: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<[u8; UNIQUE_ID_BYTES], i32>>,
    > = std::sync::OnceLock::new();
    G.get_or_init(Default::default)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetUniqueId(
    comm: NcclComm,
    unique_id: *mut NcclUniqueId,
) -> c_int {
    call("ncclCommGetUniqueId", || {
        requires("ncclCommGetUniqueId", 22902)?;
        let c = comm_of(comm)?;
        let unique_id = out(unique_id, "uniqueId")?;
        require_idle(&c, "ncclCommGetUniqueId")?;
        let mut pending = lock(&c.clique.grow_id);
        if pending.is_some() {
            return fail(
                INVALID_USAGE,
                "a grow identifier of this communicator has not been consumed yet (one grow at a time)",
            );
        }
        let id = comm::new_unique_id();
        *pending = Some(id);
        c.clique.grow_ready.notify_all();
        lock(grow_parents()).insert(id, c.nranks);
        *unique_id = NcclUniqueId { internal: id };
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
        requires("ncclCommGrow", 22902)?;
        let newcomm = out(newcomm, "newcomm")?;
        if comm.is_null() {
            // A new rank: the coordinator's identifier and a rank from the parent's size on.
            if unique_id.is_null() {
                return fail(
                    INVALID_ARGUMENT,
                    "a new rank (comm NULL) needs the uniqueId the coordinator got from ncclCommGetUniqueId",
                );
            }
            let id = (*unique_id).internal;
            let Some(parent) = lock(grow_parents()).get(&id).copied() else {
                return fail(
                    INVALID_ARGUMENT,
                    "uniqueId is not an unconsumed grow identifier from ncclCommGetUniqueId",
                );
            };
            ncclreshard_nccl_api::grow_new_rank(rank, nranks, parent)?;
            let blocking = child_blocking(None, config)?;
            let child = comm::join(id, nranks, rank, comm::calling_device(), blocking)?;
            *newcomm = child.handle as NcclComm;
            return complete_init(child, "non-blocking ncclCommGrow", || {});
        }
        let c = comm_of(comm)?;
        ncclreshard_nccl_api::grow_existing_rank(rank, nranks, c.nranks)?;
        require_idle(&c, "ncclCommGrow")?;
        // The coordinator names the identifier; the others learn it from the clique (NCCL
        // coordinates internally): they wait for it.
        let id = {
            let mut pending = lock(&c.clique.grow_id);
            if !unique_id.is_null() && *pending != Some((*unique_id).internal) {
                return fail(
                    INVALID_ARGUMENT,
                    "uniqueId is not the grow identifier ncclCommGetUniqueId made for this communicator",
                );
            }
            let entry = crate::watchdog::blocked_init(&c);
            while pending.is_none() {
                pending = c
                    .clique
                    .grow_ready
                    .wait(pending)
                    .unwrap_or_else(|p| p.into_inner());
            }
            drop(entry);
            pending.expect("set")
        };
        let blocking = child_blocking(Some(&c), config)?;
        let child = comm::join(id, nranks, c.rank, c.device, blocking)?;
        *newcomm = child.handle as NcclComm;
        // The identifier is consumed once every rank has joined.
        let clique = c.clique.clone();
        complete_init(child, "non-blocking ncclCommGrow", move || {
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
    f: impl FnOnce(&comm::Comm) -> i32,
) -> c_int {
    call(name, || {
        let c = comm_of(comm)?;
        let value = out(value, "value")?;
        c.ensure_ready()?;
        *value = f(&c);
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: NcclComm, count: *mut c_int) -> c_int {
    comm_int("ncclCommCount", comm, count, |c| c.nranks)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: NcclComm, rank: *mut c_int) -> c_int {
    comm_int("ncclCommUserRank", comm, rank, |c| c.rank)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: NcclComm, device: *mut c_int) -> c_int {
    comm_int("ncclCommCuDevice", comm, device, |c| c.device)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: NcclComm, result: *mut c_int) -> c_int {
    call("ncclCommGetAsyncError", || {
        let c = comm_of(comm)?;
        *out(result, "asyncError")? = lock(&c.status).async_error;
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    diag::boundary("ncclGetErrorString", || {
        super::error_string(result).as_ptr()
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(_comm: NcclComm) -> *const c_char {
    diag::boundary("ncclGetLastError", super::last_error)
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupStart() -> c_int {
    call("ncclGroupStart", || {
        group::start();
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupEnd() -> c_int {
    diag::boundary("ncclGroupEnd", || match group::end() {
        Ok(r) => r,
        Err(e) => {
            super::set_last_error(&e.message);
            e.result
        }
    })
}

fn check_dtype(dtype: c_int) -> NResult<()> {
    if reduce::size_of(dtype).is_none() {
        return fail(INVALID_ARGUMENT, format!("invalid datatype {dtype}"));
    }
    Ok(())
}

fn check_peer(c: &comm::Comm, peer: c_int, what: &str) -> NResult<()> {
    if peer < 0 || peer >= c.nranks {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "{what} {peer} is out of range for a communicator of {} ranks",
                c.nranks
            ),
        );
    }
    Ok(())
}

fn post(comm: NcclComm, kind: OpKind, stream: *mut c_void) -> NResult<i32> {
    let c = comm_of(comm)?;
    group::post(&c, kind, stream as usize)
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
        check_dtype(datatype)?;
        check_peer(&*comm_of(comm)?, peer, "peer")?;
        post(
            comm,
            OpKind::Send {
                buf: sendbuff as u64,
                count: count as u64,
                dtype: datatype,
                peer,
            },
            stream,
        )
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
        check_dtype(datatype)?;
        check_peer(&*comm_of(comm)?, peer, "peer")?;
        post(
            comm,
            OpKind::Recv {
                buf: recvbuff as u64,
                count: count as u64,
                dtype: datatype,
                peer,
            },
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> c_int {
    call("ncclAllReduce", || {
        check_dtype(datatype)?;
        if !reduce::reducible(datatype) {
            return fail(
                INVALID_USAGE,
                format!("ncclAllReduce on datatype {datatype}: the emulator does not reduce fp8"),
            );
        }
        if !(0..=4).contains(&op) {
            return fail(
                INVALID_ARGUMENT,
                format!("invalid reduction operation {op}"),
            );
        }
        post(
            comm,
            OpKind::AllReduce {
                send: sendbuff as u64,
                recv: recvbuff as u64,
                count: count as u64,
                dtype: datatype,
                op,
            },
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> c_int {
    call("ncclBroadcast", || {
        check_dtype(datatype)?;
        check_peer(&*comm_of(comm)?, root, "root")?;
        post(
            comm,
            OpKind::Broadcast {
                send: sendbuff as u64,
                recv: recvbuff as u64,
                count: count as u64,
                dtype: datatype,
                root,
            },
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> c_int {
    call("ncclAllGather", || {
        check_dtype(datatype)?;
        post(
            comm,
            OpKind::AllGather {
                send: sendbuff as u64,
                recv: recvbuff as u64,
                count: sendcount as u64,
                dtype: datatype,
            },
            stream,
        )
    })
}
