//! NCCL's C entry points (signatures from nccl.h).

use super::comm::{self, UNIQUE_ID_BYTES};
use super::group;
use super::ops::OpKind;
use super::reduce;
use super::{fail, NResult, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, SUCCESS};
use crate::config::config;
use crate::diag;
use crate::handles::lock;
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

/// Reads `blocking` from an `ncclConfig_t`, honoring its size/magic/version header as NCCL does.
unsafe fn config_blocking(config: *const c_void) -> NResult<bool> {
    if config.is_null() {
        return Ok(true);
    }
    let size = std::ptr::read_unaligned(config.cast::<usize>());
    let magic = std::ptr::read_unaligned(config.cast::<u8>().add(8).cast::<u32>());
    let version = std::ptr::read_unaligned(config.cast::<u8>().add(12).cast::<u32>());
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
    match std::ptr::read_unaligned(config.cast::<u8>().add(16).cast::<i32>()) {
        0 => Ok(false),
        1 | i32::MIN => Ok(true),
        v => fail(
            INVALID_ARGUMENT,
            format!("Invalid config blocking attribute value {v}"),
        ),
    }
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
    if group::depth() > 0 {
        group::defer_init(c);
        return Ok(SUCCESS);
    }
    if blocking {
        comm::finish_init(&c);
        return Ok(SUCCESS);
    }
    let delay = config().nonblocking_delay;
    std::thread::spawn(move || {
        diag::boundary("non-blocking ncclCommInitRank", || {
            c.clique.wait_complete(&c);
            std::thread::sleep(delay);
            c.set_async(SUCCESS);
        })
    });
    Ok(IN_PROGRESS)
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
