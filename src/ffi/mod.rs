//! The C ABI (docs/design.md §3): the only module with `#[no_mangle]` exports and C naming.
//!
//! Every export runs inside `boundary::boundary`: arguments are NULL-checked and validated,
//! errors return NCCL result codes with a message in `ncclReshardGetLastError()`, outputs are
//! written only on success, and no panic crosses into C. `include/ncclReshard.h` is generated
//! from this module by cbindgen (see `tests/header.rs`).

#![allow(non_camel_case_types, non_snake_case)]
// The safety contract of every export is its C documentation: pointers are NULL or valid for
// the sizes it states, handles come from ncclReshardPlanCreate.
#![allow(clippy::missing_safety_doc)]

mod boundary;
mod decode;
mod export;
mod local_shape;
pub mod types;

use crate::error::{Error, Result};
use crate::exec::{Plan, StagingLimit};
use crate::transport::nccl::NcclTransport;
use boundary::{arg, array, boundary, read_versioned, write_versioned};
use std::os::raw::{c_char, c_int, c_void};
pub use types::*;

// The crate version as NCCL-style numbers (the version lives in Cargo.toml only); the header
// gets the same macros from tests/header.rs, which derives them from the same place.
/// cbindgen:ignore
pub const NCCL_RESHARD_MAJOR: c_int = parse_version(env!("CARGO_PKG_VERSION_MAJOR"));
/// cbindgen:ignore
pub const NCCL_RESHARD_MINOR: c_int = parse_version(env!("CARGO_PKG_VERSION_MINOR"));
/// cbindgen:ignore
pub const NCCL_RESHARD_PATCH: c_int = parse_version(env!("CARGO_PKG_VERSION_PATCH"));
/// cbindgen:ignore
pub const NCCL_RESHARD_VERSION_CODE: c_int =
    NCCL_RESHARD_MAJOR * 10000 + NCCL_RESHARD_MINOR * 100 + NCCL_RESHARD_PATCH;

const fn parse_version(text: &str) -> c_int {
    let bytes = text.as_bytes();
    let mut value = 0;
    let mut i = 0;
    while i < bytes.len() {
        value = value * 10 + (bytes[i] - b'0') as c_int;
        i += 1;
    }
    value
}

/// `ncclInProgress`.
const NCCL_IN_PROGRESS: ncclResult_t = 7;

/// An opaque reshard plan: created once per rank by `ncclReshardPlanCreate`, immutable after,
/// destroyed by `ncclReshardPlanDestroy`. The core's plan and the NCCL transport that runs it.
pub struct ncclReshardPlan {
    plan: Plan,
    nccl: NcclTransport,
}

/// Handle to a plan.
pub type ncclReshardPlan_t = *mut ncclReshardPlan;

fn plan_ref<'a>(plan: ncclReshardPlan_t) -> Result<&'a ncclReshardPlan> {
    // SAFETY: a non-NULL plan handle comes from ncclReshardPlanCreate and has not been
    // destroyed (the API contract); plans are immutable, so shared access is sound.
    unsafe { arg(plan.cast_const(), "plan") }
}

/// Creates this rank's plan for resharding `ntensors` tensors.
///
/// Every participating rank must call it with identical `tensors` (except the per-rank
/// `srcOffset`/`dstOffset`) and `config`; the plan is computed locally and deterministically,
/// with no communication. `rank` is this rank's rank in the communicator that will run the
/// plan. `config` may be NULL for defaults. The descriptors (and the arrays they point to) are
/// read during the call only.
///
/// On success `*plan` receives a new plan; on error `*plan` is left untouched.
///
/// Thread-safe; host-only (no CUDA or NCCL call), so it may be called anywhere, also during a
/// CUDA graph capture and inside an NCCL group. Errors: `ncclInvalidArgument` (a field, named
/// with its value, e.g. `tensors[2].src->placements[1].dim is 3…`), `ncclInvalidUsage` (a plan
/// the limits refuse: staging over `maxStagingBytes`, groupable mode past its message cap),
/// `ncclInternalError` (a bug).
#[no_mangle]
pub unsafe extern "C" fn ncclReshardPlanCreate(
    plan: *mut ncclReshardPlan_t,
    ntensors: c_int,
    tensors: *const ncclReshardTensor_t,
    rank: c_int,
    config: *const ncclReshardConfig_t,
) -> ncclResult_t {
    boundary("ncclReshardPlanCreate", || {
        if plan.is_null() {
            return Err(Error::invalid_argument("plan is NULL"));
        }
        let rank = u32::try_from(rank).map_err(|_| {
            Error::invalid_argument(format!("rank is {rank}; ranks are non-negative"))
        })?;
        // SAFETY: the caller passes ntensors valid descriptors and a NULL or valid config.
        let tensors = unsafe { decode::tensors(tensors, ntensors) }?;
        let (config, call) = unsafe { decode::config(config) }?;
        let staging = StagingLimit::new(call.max_staging_bytes);
        let core = if call.failed_ranks.is_empty() {
            Plan::new(tensors, rank, config, staging, NcclTransport::LIMITS)?
        } else {
            Plan::survivors(
                tensors,
                &call.failed_ranks,
                rank,
                config,
                staging,
                NcclTransport::LIMITS,
            )?
        };
        let nccl = NcclTransport::for_plan(&core).with_deadline(call.timeout_ms);
        let handle = Box::into_raw(Box::new(ncclReshardPlan { plan: core, nccl }));
        // SAFETY: plan is non-NULL and writable per the contract.
        unsafe { plan.write(handle) };
        Ok(())
    })
}

/// Destroys a plan. NULL is a no-op. The plan must not be in use by any call, and work it
/// enqueued must have completed, before it is destroyed.
///
/// Frees the plan's device memory when it ran on a GPU, so not during a CUDA graph capture of
/// that device (CUDA forbids freeing there). Errors: none but `ncclInternalError`.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardPlanDestroy(plan: ncclReshardPlan_t) -> ncclResult_t {
    boundary("ncclReshardPlanDestroy", || {
        if !plan.is_null() {
            // SAFETY: a non-NULL handle came from Box::into_raw in ncclReshardPlanCreate and is
            // destroyed once (the API contract).
            drop(unsafe { Box::from_raw(plan) });
        }
        Ok(())
    })
}

/// Reshards every tensor of `plan`: this rank's source views are read from `sendbuff` (+ each
/// tensor's `srcOffset`), its destination views written into `recvbuff` (+ `dstOffset`).
///
/// Stream-ordered and asynchronous: returns once the work is enqueued on `stream`; the
/// destination is complete when `stream` reaches that point (after the outermost
/// `ncclGroupEnd` when called inside a group). Sources must not change until then.
/// `sendbuff` may be NULL on a rank outside every source mesh and `recvbuff` on a rank outside
/// every destination mesh; a rank with nothing to do may skip the call. The two buffers must
/// not overlap.
///
/// Groups: a plan created in `ncclReshardModeGroupable` may be called between
/// `ncclGroupStart`/`ncclGroupEnd`, any number of times, with other NCCL operations; its work
/// is issued at the outermost `ncclGroupEnd`. Any other plan called inside a group returns
/// `ncclInvalidUsage` on every rank before any NCCL operation of its own (NCCL has no query for
/// an open group, so the library detects it by calling `ncclGroupEnd`, which issues what the
/// group holds so far, and reopens the group).
///
/// CUDA graphs: after the plan's first call on its device (which compiles and loads the
/// kernel and uploads the plan; it synchronises a private stream), calls only enqueue work and
/// can be captured, on any stream of the device; staging is a graph memory allocation. A first
/// call during a capture is refused with `ncclInvalidUsage` and leaves the capture valid.
///
/// Thread safety: a plan may be used by several threads at once, on different streams and
/// communicators (one communicator must not be used by two threads at once, as NCCL requires).
/// `stream` must belong to the primary context of the communicator's device.
///
/// Errors, all before the call's first NCCL operation unless said: `ncclInvalidArgument` (a
/// NULL or overlapping buffer, a buffer or stream on another device or context),
/// `ncclInvalidUsage` (the communicator's rank or size does not fit the plan, a plan not made in
/// groupable mode inside a group, a first call during capture, `NCCL_RESHARD_CHECK=1` finding a
/// peer that planned differently), `ncclSystemError` (CUDA driver, NVRTC or NCCL not found),
/// `ncclUnhandledCudaError` and NCCL's own codes with the underlying text; a CUDA or NCCL
/// failure after the first NCCL operation is returned after the call has still posted all its
/// NCCL groups, so that no peer waits forever.
#[no_mangle]
pub unsafe extern "C" fn ncclReshard(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    plan: ncclReshardPlan_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    boundary("ncclReshard", || {
        let handle = plan_ref(plan)?;
        let buffers = handle
            .plan
            .views()
            .single(sendbuff as usize, recvbuff as usize)?;
        handle.nccl.execute(&buffers, comm, stream)
    })
}

/// Like `ncclReshard`, with one source and one destination pointer per tensor (in plan
/// order): `sendbuffs[t]` is tensor t's source view, `recvbuffs[t]` its destination view
/// (`srcOffset`/`dstOffset`/`scaleOffset` are not used). A plan with quantized tensors also
/// takes their scale views: `recvbuffs[ntensors + k]` is the k-th quantized tensor's (in
/// tensor order; `ncclReshardPlanInfo_t.scaleTensors` says how many). Either array may be NULL
/// on a rank that has no views on that side; entries for tensors this rank does not hold on a
/// side may be NULL.
/// Groups, graphs, threads and errors as for `ncclReshard`.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardMulti(
    sendbuffs: *const *const c_void,
    recvbuffs: *const *mut c_void,
    plan: ncclReshardPlan_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    boundary("ncclReshardMulti", || {
        let handle = plan_ref(plan)?;
        let plan = &handle.plan;
        let pointers = |table: *const usize, n: usize, name: &str| -> Result<&[usize]> {
            if table.is_null() {
                return Ok(&[]);
            }
            // SAFETY: a non-NULL table holds one pointer per tensor, and recvbuffs one more
            // per scale tensor (the API contract).
            unsafe { array(table, n, name) }
        };
        let send = pointers(sendbuffs.cast(), plan.ntensors(), "sendbuffs")?;
        let recv = pointers(recvbuffs.cast(), plan.ndestinations(), "recvbuffs")?;
        let buffers = plan.views().per_tensor(send, recv)?;
        handle.nccl.execute(&buffers, comm, stream)
    })
}

/// The outcome of this rank's calls with a deadline (`config.timeoutMs`,
/// `NCCL_RESHARD_TIMEOUT_MS`) on `comm`: `*status` receives `ncclSuccess` once none is running
/// and none failed, `ncclInProgress` while one is still running (within its deadline), or the
/// failure, `ncclRemoteError`: a call missed its deadline (a peer died, stalled or never
/// called) or NCCL reported an asynchronous error, and the library revoked `comm` so that every
/// operation pending on it ended; `ncclReshardGetLastError()` then says which call, what had
/// not completed (a round and its peers), and what to do next (shrink `comm` with
/// `ncclReshardCommShrink`, create the survivors' plan with `config.failedRanks`, call again).
/// The failure stays until `comm` is shrunk through `ncclReshardCommShrink`. Calls without a
/// deadline are not counted.
///
/// Thread-safe; host-only, never waits. Errors: `ncclInvalidArgument` (NULL).
#[no_mangle]
pub unsafe extern "C" fn ncclReshardCommGetStatus(
    comm: ncclComm_t,
    status: *mut ncclResult_t,
) -> ncclResult_t {
    boundary("ncclReshardCommGetStatus", || {
        if comm.is_null() {
            return Err(Error::invalid_argument("comm is NULL"));
        }
        if status.is_null() {
            return Err(Error::invalid_argument("status is NULL"));
        }
        let outcome = match crate::transport::nccl::comm_status(comm) {
            Ok(true) => ncclResult_t::from(0),
            Ok(false) => NCCL_IN_PROGRESS,
            Err(e) => {
                let code = boundary::code(e.kind);
                boundary::set_last_error(&e.message);
                code
            }
        };
        // SAFETY: non-NULL and writable per the contract.
        unsafe { status.write(outcome) };
        Ok(())
    })
}

/// Waits until none of this rank's calls with a deadline on `comm` is running, and returns
/// their outcome as `ncclReshardCommGetStatus` gives it: `ncclSuccess`, or the failure
/// (`ncclRemoteError`, detail in `ncclReshardGetLastError()`). A call ends by its deadline
/// (counted from when its stream reaches it) plus the watchdog's few milliseconds and the
/// revoke, so this wait is bounded once every stream has reached the calls. Does not wait for
/// streams otherwise: synchronize them as usual.
///
/// Thread-safe; host-only. Errors: `ncclInvalidArgument` (NULL), `ncclRemoteError`.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardCommWait(comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclReshardCommWait", || {
        if comm.is_null() {
            return Err(Error::invalid_argument("comm is NULL"));
        }
        crate::transport::nccl::comm_wait(comm)
    })
}

/// Revokes `comm` now, for an application that learned otherwise that a rank is gone: every
/// operation pending on it ends (`ncclCommRevoke`), this rank's running calls with a deadline
/// fail, and nothing more may be posted on it (calls of any plan on it are refused with
/// `ncclInvalidUsage`): shrink it with `ncclReshardCommShrink`. With an NCCL older than 2.28.7
/// (no `ncclCommRevoke`), `comm` is aborted (`ncclCommAbort`) instead: it is gone, do not
/// destroy it.
///
/// Thread-safe (may run beside a call on `comm` in another thread); host-only. Errors:
/// `ncclInvalidArgument` (NULL), `ncclSystemError` (no NCCL).
#[no_mangle]
pub unsafe extern "C" fn ncclReshardCommRevoke(comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclReshardCommRevoke", || unsafe {
        crate::transport::nccl::comm_revoke(comm)
    })
}

/// `ncclCommShrink` of the NCCL the library uses (2.27.3 or newer): the survivors (and only
/// they) call it with the same `excludeRanksList` (the failed ranks, of `comm`) and get
/// `*newcomm`, on which each keeps its order (its rank less the excluded ranks below it).
/// `config` may be NULL (the parent's configuration). `shrinkFlags` is `NCCL_SHRINK_DEFAULT`
/// (0: `comm` must have nothing pending) or `NCCL_SHRINK_ABORT` (1: after a failure); a `comm`
/// the library revoked is always shrunk with `NCCL_SHRINK_ABORT`. Returns once the new
/// communicator is ready (also for a non-blocking one), after which the library forgets `comm`'s
/// failure; destroy `comm` with `ncclCommDestroy`. The survivors' plan is created with
/// `config.failedRanks` (the same list).
///
/// Host-only. Errors: `ncclInvalidArgument` (NULL, a count of 0 or below: NCCL shrinks by
/// one rank or more; after a revoke with every rank alive, make a new communicator),
/// `ncclInvalidUsage` (the NCCL has no `ncclCommShrink`, naming the version needed; `comm` was
/// aborted), and NCCL's own codes, with nothing written.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *const c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    boundary("ncclReshardCommShrink", || {
        if newcomm.is_null() {
            return Err(Error::invalid_argument("newcomm is NULL"));
        }
        let count = decode::count(excludeRanksCount, i32::MAX as usize, "excludeRanksCount")?;
        let list: &[c_int] = if count == 0 {
            &[]
        } else {
            // SAFETY: the list holds excludeRanksCount ranks (the API contract).
            unsafe { array(excludeRanksList, count, "excludeRanksList") }?
        };
        if !(0..=1).contains(&shrinkFlags) {
            return Err(Error::invalid_argument(format!(
                "shrinkFlags is {shrinkFlags}; use NCCL_SHRINK_DEFAULT (0) or NCCL_SHRINK_ABORT (1)"
            )));
        }
        // SAFETY: forwarded contract.
        let made =
            unsafe { crate::transport::nccl::comm_shrink(comm, list, config, shrinkFlags == 1) }?;
        // SAFETY: non-NULL and writable per the contract.
        unsafe { newcomm.write(made) };
        Ok(())
    })
}

/// `ncclCommGetUniqueId` of the NCCL the library uses (2.29.2 or newer): the coordinator of a
/// grow (one existing rank) gets the identifier it hands to the new ranks.
///
/// Host-only. Errors: `ncclInvalidArgument` (NULL), `ncclInvalidUsage` (the NCCL has no
/// `ncclCommGrow`, naming the version needed), NCCL's own codes.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardCommGetUniqueId(
    comm: ncclComm_t,
    uniqueId: *mut ncclUniqueId,
) -> ncclResult_t {
    boundary("ncclReshardCommGetUniqueId", || {
        if uniqueId.is_null() {
            return Err(Error::invalid_argument("uniqueId is NULL"));
        }
        // SAFETY: forwarded contract.
        let id = unsafe { crate::transport::nccl::comm_get_unique_id(comm) }?;
        let mut out = ncclUniqueId { internal: [0; 128] };
        for (o, &b) in out.internal.iter_mut().zip(&id) {
            *o = b as c_char;
        }
        // SAFETY: non-NULL and writable per the contract.
        unsafe { uniqueId.write(out) };
        Ok(())
    })
}

/// `ncclCommGrow` of the NCCL the library uses (2.29.2 or newer): existing ranks pass their
/// `comm`, `rank` -1 and (the coordinator only, else NULL) `uniqueId`; new ranks pass `comm`
/// NULL, the coordinator's `uniqueId` and their rank (from the parent's size to `nRanks` - 1).
/// Returns once `*newcomm` is ready; destroy the parent afterwards. A plan for the grown
/// communicator names the new ranks in its layouts (they come after the old ones).
///
/// Host-only. Errors: `ncclInvalidArgument` (NULL `newcomm`), `ncclInvalidUsage` (the NCCL
/// has no `ncclCommGrow`, naming the version needed), NCCL's own codes.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardCommGrow(
    comm: ncclComm_t,
    nRanks: c_int,
    uniqueId: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    boundary("ncclReshardCommGrow", || {
        if newcomm.is_null() {
            return Err(Error::invalid_argument("newcomm is NULL"));
        }
        let id = if uniqueId.is_null() {
            None
        } else {
            // SAFETY: a non-NULL uniqueId points to one identifier.
            let id = unsafe { &*uniqueId };
            let mut bytes = [0u8; 128];
            for (b, &c) in bytes.iter_mut().zip(&id.internal) {
                *b = c as u8;
            }
            Some(bytes)
        };
        // SAFETY: forwarded contract.
        let made =
            unsafe { crate::transport::nccl::comm_grow(comm, nRanks, id.as_ref(), rank, config) }?;
        // SAFETY: non-NULL and writable per the contract.
        unsafe { newcomm.write(made) };
        Ok(())
    })
}

/// Fills `*info` with what the plan does on its rank. Set `info->size` first (use
/// `NCCL_RESHARD_PLAN_INFO_INITIALIZER`); fields beyond it are not written.
///
/// Thread-safe; host-only, callable anywhere. Errors: `ncclInvalidArgument` (NULL or a `size`
/// below the 0.1 struct's).
#[no_mangle]
pub unsafe extern "C" fn ncclReshardPlanGetInfo(
    plan: ncclReshardPlan_t,
    info: *mut ncclReshardPlanInfo_t,
) -> ncclResult_t {
    boundary("ncclReshardPlanGetInfo", || {
        let plan = &plan_ref(plan)?.plan;
        // SAFETY: info is NULL or points to a struct of at least its stated size.
        let caller = unsafe {
            read_versioned(
                info.cast_const(),
                decode::INFO_MIN_SIZE,
                ncclReshardPlanInfo_t::default(),
                "info",
            )
        }?;
        // SAFETY: as above; the write is bounded by the caller's size.
        unsafe { write_versioned(info, &export::info(plan), caller.size) };
        Ok(())
    })
}

/// This rank's part of the plan as data, complete enough for another transport (NIXL, RDMA
/// writes, host copies, …) to run it instead of `ncclReshard`: every byte the rank sends,
/// receives or copies locally, once, as strided byte copies with their rounds (see
/// `ncclReshardTransfer_t` for the geometry, the execution rule and how sends match receives).
/// Running every rank's transfers under that rule leaves exactly what `ncclReshard` leaves in
/// the destination views and writes no byte outside them.
///
/// Transfers are listed by round, ascending; within a round the convert transfers reading the
/// source view first (the round's conversions), then the others in canonical block order
/// (tensor, then the block's position), the pieces of a block by `blockOffset`; the convert
/// transfers after the last round come last. Their bytes add up, kind
/// by kind, to `bytesSent`, `bytesReceived` and `bytesCopied` of `ncclReshardPlanGetInfo`, and
/// per peer and round to what `ncclReshard` sends and receives (its messages pack several
/// transfers together or send one as it is; they are not listed).
///
/// With `transfers` NULL, only `*count` is set to the number of transfers. Otherwise
/// `transfers` holds `capacity` structs whose first has `size` set (use
/// `NCCL_RESHARD_TRANSFER_INITIALIZER`; every struct is taken to have that size, so a caller
/// built against an older header gets the fields it knows); all transfers are written and
/// `*count` set, or, when `capacity` is too small, nothing is written and
/// `ncclInvalidArgument` is returned. A struct without `srcView` (before 0.2) cannot tell a
/// forward from a send: for a plan with forwards nothing is written and `ncclInvalidUsage` is
/// returned. The plan is immutable: every call returns the same list.
///
/// Thread-safe; host-only, callable anywhere.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardPlanGetTransfers(
    plan: ncclReshardPlan_t,
    transfers: *mut ncclReshardTransfer_t,
    capacity: c_int,
    count: *mut c_int,
) -> ncclResult_t {
    boundary("ncclReshardPlanGetTransfers", || {
        let plan = &plan_ref(plan)?.plan;
        if count.is_null() {
            return Err(Error::invalid_argument("count is NULL"));
        }
        let entries = export::transfers(plan)?;
        let total = c_int::try_from(entries.len()).map_err(|_| {
            Error::invalid_usage("the plan has more transfers than an int can count")
        })?;
        // With nothing to write, `transfers` may be an empty array: it is not read.
        if !transfers.is_null() && total > 0 {
            if capacity < total {
                return Err(Error::invalid_argument(format!(
                    "capacity is {capacity} but the plan has {total} transfers; call with transfers = NULL to get the count"
                )));
            }
            // SAFETY: transfers[0] begins with the stride the caller uses.
            let first = unsafe {
                read_versioned(
                    transfers.cast_const(),
                    decode::TRANSFER_MIN_SIZE,
                    ncclReshardTransfer_t::default(),
                    "transfers[0]",
                )
            }?;
            // A forward read as an ordinary send would read the wrong view: refuse rather than
            // hand an older caller a list it cannot run.
            let forwards = entries
                .iter()
                .any(|t| t.srcView == ncclReshardView_t::ncclReshardViewDestination as c_int);
            if first.size < decode::TRANSFER_SRC_VIEW_SIZE && forwards {
                return Err(Error::invalid_usage(format!(
                    "transfers[0].size is {} (a struct from before 0.2, without srcView) but this plan forwards relayed data (transfers that read the sender's destination view); build against the current header (size {}) or plan with config.relay = 0",
                    first.size,
                    std::mem::size_of::<ncclReshardTransfer_t>()
                )));
            }
            // Converted data read as plain bytes would be wrong: the same refusal.
            let converts = entries.iter().any(|t| {
                t.kind == ncclReshardTransferKind_t::ncclReshardTransferConvert as c_int
                    || t.dstView != ncclReshardView_t::ncclReshardViewDestination as c_int
                    || t.srcView > ncclReshardView_t::ncclReshardViewDestination as c_int
            });
            if first.size < decode::TRANSFER_CONVERT_SIZE && converts {
                return Err(Error::invalid_usage(format!(
                    "transfers[0].size is {} (a struct from before 0.4, without dstView, the dtypes and the scale fields) but this plan converts tensors on the way; build against the current header (size {})",
                    first.size,
                    std::mem::size_of::<ncclReshardTransfer_t>()
                )));
            }
            for (i, entry) in entries.iter().enumerate() {
                // SAFETY: the caller's array holds `capacity` ≥ total structs of `first.size`
                // bytes each.
                unsafe {
                    let at = transfers
                        .cast::<u8>()
                        .add(i * first.size)
                        .cast::<ncclReshardTransfer_t>();
                    write_versioned(at, entry, first.size);
                }
            }
        }
        // SAFETY: count is non-NULL and writable.
        unsafe { count.write(total) };
        Ok(())
    })
}

/// A rank's local shape (and optionally its index runs) under `layout` for a tensor of `ndim`
/// dims and global `shape`, so callers can allocate views.
///
/// `localShape` receives `ndim` sizes. When `runsPerDim` is not NULL it receives, per dim, the
/// number of `[start, end)` runs of global indices the rank holds; when `runs` is not NULL too
/// it receives all runs (dim 0's first) as `start, end` pairs, and `runsCapacity` (in pairs)
/// must be large enough. `rank` must be in the layout's mesh.
///
/// Thread-safe; host-only, callable anywhere. Errors: `ncclInvalidArgument` (a field of
/// `layout` or an argument, named), with no output written.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardLocalShape(
    layout: *const ncclReshardLayout_t,
    ndim: c_int,
    shape: *const i64,
    rank: c_int,
    localShape: *mut i64,
    runs: *mut i64,
    runsCapacity: c_int,
    runsPerDim: *mut c_int,
) -> ncclResult_t {
    boundary("ncclReshardLocalShape", || {
        // SAFETY: pointers are NULL or valid for the lengths the arguments state.
        unsafe {
            local_shape::local_shape(
                layout,
                ndim,
                shape,
                rank,
                localShape,
                runs,
                runsCapacity,
                runsPerDim,
            )
        }
    })
}

/// The detail of this thread's last failing call (never NULL; empty when none failed). Valid
/// until the next failing call on this thread. Thread-safe (per thread); callable anywhere.
#[no_mangle]
pub extern "C" fn ncclReshardGetLastError() -> *const c_char {
    boundary::text_boundary(boundary::last_error_ptr)
}

/// A static description of an `ncclResult_t` (never NULL). Thread-safe; callable anywhere.
#[no_mangle]
pub extern "C" fn ncclReshardGetErrorString(result: ncclResult_t) -> *const c_char {
    boundary::text_boundary(|| boundary::error_string(result).as_ptr())
}

/// The library's version as `NCCL_RESHARD_VERSION_CODE` (compare with the header's macro to
/// detect a header/library mismatch). Thread-safe; callable anywhere. Errors:
/// `ncclInvalidArgument` (NULL).
#[no_mangle]
pub unsafe extern "C" fn ncclReshardGetVersion(version: *mut c_int) -> ncclResult_t {
    boundary("ncclReshardGetVersion", || {
        if version.is_null() {
            return Err(Error::invalid_argument("version is NULL"));
        }
        // SAFETY: non-NULL and writable per the contract.
        unsafe { version.write(NCCL_RESHARD_VERSION_CODE) };
        Ok(())
    })
}

/// Which libnccl the library uses: `*path` receives the file that defines its NCCL functions
/// (owned by the library, valid for the process's life) and `*ncclVersion` that NCCL's
/// `ncclGetVersion` code (e.g. 22805). Loads NCCL by the same rule as the first call of
/// `ncclReshard` would (if no call has yet), so a caller can check, before making
/// communicators, that they come from the same NCCL:
///
/// 1. `NCCL_RESHARD_NCCL_LIBRARY`, when it names the NCCL already mapped in the process or
///    none is mapped; naming another file while an NCCL is mapped is refused (loading it would
///    map a second copy, and a communicator made by one NCCL is garbage to another);
/// 2. else the NCCL in the global namespace (a program linked against libnccl);
/// 3. else the one NCCL mapped privately (`RTLD_LOCAL`: Python's ctypes and extension modules,
///    PyTorch's and vLLM's NCCL), whatever its file name; several distinct ones are refused;
/// 4. else `dlopen("libnccl.so.2")`.
///
/// The choice is made once per process; `NCCL_RESHARD_DEBUG=INFO` logs it. Thread-safe;
/// host-only. Errors: `ncclInvalidArgument` (NULL), `ncclSystemError` (no NCCL can be loaded,
/// or the rule refuses, with the files named), and nothing written.
#[no_mangle]
pub unsafe extern "C" fn ncclReshardGetNcclLibrary(
    path: *mut *const c_char,
    ncclVersion: *mut c_int,
) -> ncclResult_t {
    boundary("ncclReshardGetNcclLibrary", || {
        if path.is_null() {
            return Err(Error::invalid_argument("path is NULL"));
        }
        if ncclVersion.is_null() {
            return Err(Error::invalid_argument("ncclVersion is NULL"));
        }
        let nccl = crate::transport::nccl::library::nccl()?;
        let version = nccl.version();
        // SAFETY: both are non-NULL and writable per the contract; the string lives in the
        // process-wide NCCL table, which is never dropped.
        unsafe {
            path.write(nccl.path.as_ptr());
            ncclVersion.write(version);
        }
        Ok(())
    })
}
