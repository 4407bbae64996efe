//! The NCCL transport (docs/executor.md): runs one rank's program on the caller's CUDA stream
//! and NCCL communicator. Its rounds are NCCL groups (`groups.rs`); its local steps are the GPU
//! runtime's (`crate::gpu`); NCCL is taken from the process (`library.rs`).
//!
//! A call, in phases: [`NcclTransport::execute`] checks what it runs on (communicator, buffers,
//! stream), warms up on the first call on a device (kernel, tables), refuses what the caller's
//! NCCL group or a graph capture does not allow, takes its staging and side stream, exchanges
//! fingerprints with every peer, walks the program (`exec::schedule`), and gives back what it
//! took. Everything that can refuse the call does so before its first NCCL operation, and
//! decides from plan-wide facts, so every rank refuses alike. Later calls only pass pointers as
//! kernel arguments, so they can be captured into a CUDA graph.

mod deadline;
mod group_depth;
mod groups;
pub(crate) mod library;

use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::buffers::CallBuffers;
use crate::exec::{schedule, Limits, Plan};
use crate::gpu::{driver, Device, DeviceCall, DeviceLimits, DeviceProgram, PlanDevice, Tables};
use crate::plan::{Mode, RankProgram};
use cudarc::driver::sys;
use groups::{Fingerprints, Groups};
use library::{Nccl, NcclComm};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// Runs one rank's program on GPUs with NCCL. Created with the plan (no CUDA calls); the first
/// call initialises it on the call's device. Shareable across threads: calls on different
/// streams and communicators may run at once.
pub struct NcclTransport {
    gpu: DeviceProgram,
    /// What single-buffer calls run when it differs from `gpu`: the same messages, some
    /// receives landing in place (`exec::Plan::placed`).
    single: Option<DeviceProgram>,
    /// The program's distinct peers, ascending (checked against the communicator's size on
    /// every call; fingerprint slots follow this order).
    peers: Vec<u32>,
    /// The plan was made in groupable mode: it may be called inside a caller's NCCL group.
    /// Plan-wide (the config's mode), so every rank decides the same.
    groupable: bool,
    /// `NCCL_RESHARD_CHECK=1` when the plan was created: each call waits for the peers'
    /// fingerprints and compares them before moving data.
    verify: bool,
    /// How long each call may take (`deadline.rs`); `None`: as long as NCCL takes.
    deadline: Option<Duration>,
}

/// Indices of the fingerprint buffers in the program's device constants.
const MINE: usize = 0;
const THEIRS: usize = 1;

/// The words a program keeps on the device: its fingerprint (`MINE`) and one slot per peer for
/// theirs (`THEIRS`).
fn constants(program: &RankProgram, peers: &[u32]) -> Vec<Vec<u64>> {
    vec![vec![program.fingerprint], vec![0u64; peers.len()]]
}

impl NcclTransport {
    /// What this transport can run (the GPU runtime's limits), for `exec::Plan::new`.
    pub const LIMITS: &'static dyn Limits = &DeviceLimits;

    /// `src_offsets`/`dst_offsets`: byte offsets of each tensor's views in the single-buffer
    /// call; `groupable`: the plan was created in groupable mode.
    pub fn new(
        program: Arc<RankProgram>,
        src_offsets: Vec<u64>,
        dst_offsets: Vec<u64>,
        groupable: bool,
    ) -> Self {
        let peers = program.peers();
        let constants = constants(&program, &peers);
        NcclTransport {
            gpu: DeviceProgram::new(program, src_offsets, dst_offsets, constants),
            single: None,
            peers,
            groupable,
            verify: std::env::var("NCCL_RESHARD_CHECK").is_ok_and(|v| v.trim() == "1"),
            deadline: deadline::resolve(None),
        }
    }

    /// Gives every call a deadline of `timeout_ms` milliseconds (0: none); `None` keeps
    /// `NCCL_RESHARD_TIMEOUT_MS` (read when the transport is created; unset or 0: none). See
    /// [`NcclTransport::execute`] and docs/resilience.md.
    pub fn with_deadline(mut self, timeout_ms: Option<u64>) -> Self {
        self.deadline = deadline::resolve(timeout_ms);
        self
    }

    /// The deadline of each call, if it has one.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// The transport of `plan`'s program, with its views' offsets in the single-buffer call;
    /// single-buffer calls run [`Plan::placed`] where the plan has it.
    pub fn for_plan(plan: &Plan) -> Self {
        let views = plan.views();
        let transport = NcclTransport::new(
            plan.program().clone(),
            views.src_offsets(),
            views.dst_offsets(),
            plan.mode() == Mode::Groupable,
        );
        match plan.placed() {
            Some(placed) => transport.with_single(placed.clone()),
            None => transport,
        }
    }

    /// Single-buffer calls run `program` instead: the same messages as the transport's own
    /// program (the same peers, rounds and sizes), some receives landing in place in views the
    /// offsets put back to back ([`RankProgram::dst_after`]).
    pub fn with_single(mut self, program: Arc<RankProgram>) -> Self {
        let constants = constants(&program, &self.peers);
        self.single = Some(self.gpu.sibling(program, constants));
        self
    }

    /// The program a call with `buffers` runs.
    fn device_program(&self, buffers: &CallBuffers<'_>) -> &DeviceProgram {
        match (buffers, &self.single) {
            (CallBuffers::Single { .. }, Some(single)) => single,
            _ => &self.gpu,
        }
    }

    /// Waits for and compares the peers' fingerprints on every call (default:
    /// `NCCL_RESHARD_CHECK` is `1` when the transport is created).
    pub fn with_peer_check(mut self, on: bool) -> Self {
        self.verify = on;
        self
    }

    /// Enqueues the program on `stream` with `comm`. See the module documentation. `buffers`
    /// are taken as [`RankViews`](crate::exec::buffers::RankViews) checked them (present
    /// where the rank holds data, not overlapping).
    pub fn execute(
        &self,
        buffers: &CallBuffers<'_>,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        let gpu = self.device_program(buffers);
        let p = &*gpu.program;
        if p.is_empty() {
            return Ok(());
        }
        // What the call runs on.
        // (A rank in a senders' barrier exchanges its messages even with no data to send.)
        let messages = !(p.sends.is_empty() && p.recvs.is_empty()) || p.has_barrier();
        if messages && comm.is_null() {
            return Err(Error::invalid_argument(format!(
                "comm is NULL but rank {} exchanges messages with {} peer(s)",
                p.rank,
                self.peers.len()
            )));
        }
        driver::init()?;
        let nccl = if messages {
            Some(library::nccl()?)
        } else {
            None
        };
        let (ordinal, identity) = self.device_ordinal(buffers, comm, nccl)?;
        if let Some(identity) = identity {
            // Whatever this call's deadline: a communicator the library revoked takes nothing.
            deadline::refuse_revoked(comm, identity)?;
        }
        let state = gpu.on_device(ordinal)?;
        let device = &*state.device;
        let _current = device.context.push()?;
        let cu_stream = stream as sys::CUstream;
        check_stream(cu_stream, device)?;
        let capturing = driver::is_capturing(cu_stream)?;
        // Warm-up on the first call.
        let tables = gpu.tables(&state, capturing)?;
        // What the caller's group or capture does not allow.
        if let Some(nccl) = nccl {
            self.refuse(nccl, capturing)?;
        }
        // A deadline watches the call from here, before its first NCCL operation.
        let guard = match (nccl, self.deadline, identity) {
            (Some(nccl), Some(timeout), Some(identity)) => Some(deadline::Guard::begin(
                nccl,
                comm,
                p.rank,
                identity,
                timeout,
                state.device.clone(),
            )?),
            _ => None,
        };
        // What the call takes, then the first NCCL operation: the fingerprints.
        let groups = nccl.map(|nccl| Groups {
            nccl,
            comm,
            stream: cu_stream,
            rank: p.rank,
            rounds: p.rounds_iter().count(),
            guard: guard.as_ref(),
        });
        let mut call =
            DeviceCall::begin(device, gpu, tables, buffers, cu_stream, capturing, groups)?;
        // Every way out of the call below marks its end for the plan's memory (`mark_use`).
        let mark = |state: &PlanDevice| {
            if capturing {
                Ok(())
            } else {
                state.mark_use(cu_stream)
            }
        };
        if let Some(guard) = &guard {
            if let Err(e) = guard.mark_start(cu_stream) {
                let _ = call.finish();
                let _ = mark(&state);
                return Err(e);
            }
        }
        debug::log(Level::Info, || {
            format!(
                "rank {}: {} round(s), {} local copy/pack blocks, {} sends ({} bytes), {} receives ({} bytes), {} unpack blocks, stream {stream:p}{}",
                p.rank,
                p.rounds_iter().count(),
                p.local_copies.len() + p.packs.len(),
                p.sends.len(),
                p.bytes_sent(),
                p.recvs.len(),
                p.bytes_received(),
                p.unpacks.len(),
                if capturing { " (capturing)" } else { "" }
            )
        });
        if let Some(groups) = &call.exchange {
            if let Err(e) = self.handshake(groups, tables) {
                let _ = call.finish();
                let _ = mark(&state);
                return Err(e);
            }
        }
        // The walk, then what the call took goes back (the walk's error first), then the
        // deadline watches the rest from the stream.
        let walked = schedule::run(p, &mut call);
        let finished = call.finish().and(mark(&state));
        let left = match guard {
            Some(guard) => guard.leave(cu_stream),
            None => Ok(()),
        };
        walked.and(finished).and(left)
    }

    /// Refuses, before any NCCL operation of this call, what the caller's NCCL group or a graph
    /// capture does not allow.
    fn refuse(&self, nccl: &Nccl, capturing: bool) -> Result<()> {
        let rank = self.gpu.program.rank;
        if !self.groupable {
            nccl.refuse_open_group(|| {
                format!(
                    "rank {rank}: this plan was not created in groupable mode, so it must not be called inside ncclGroupStart/ncclGroupEnd (its packs, unpacks or rounds need its NCCL operations issued at once); call it outside the group, or create the plan with mode ncclReshardModeGroupable"
                )
            })?;
        }
        if let Some(timeout) = self.deadline {
            if capturing {
                return Err(Error::invalid_usage(format!(
                    "rank {rank}: this call has a deadline ({} ms, config.timeoutMs or NCCL_RESHARD_TIMEOUT_MS), which watches each call's work from the host; a CUDA graph replays captured work without a call to watch: capture a plan without a deadline (config.timeoutMs = 0)",
                    timeout.as_millis()
                )));
            }
            if self.groupable {
                nccl.refuse_open_group(|| {
                    format!(
                        "rank {rank}: this call has a deadline ({} ms), which watches the call's NCCL operations; inside the caller's NCCL group they are issued only at its end, after the call: call outside the group, or without a deadline (config.timeoutMs = 0)",
                        timeout.as_millis()
                    )
                })?;
            }
        }
        if self.verify {
            if capturing {
                return Err(Error::invalid_usage(
                    "NCCL_RESHARD_CHECK=1 waits for the peers' fingerprints, which a CUDA graph capture cannot do; unset it while capturing",
                ));
            }
            if self.groupable {
                nccl.refuse_open_group(|| {
                    format!(
                        "rank {rank}: NCCL_RESHARD_CHECK=1 waits for the peers' fingerprints, which cannot arrive while the caller's NCCL group is open; unset it or call outside the group"
                    )
                })?;
            }
        }
        Ok(())
    }

    /// Every call of every rank, whatever its environment, exchanges fingerprints with each
    /// peer in a group of their own ahead of any data, so the messages between two ranks always
    /// pair up and no fingerprint waits behind another peer's data in NCCL's queues; only
    /// `NCCL_RESHARD_CHECK=1` waits for them.
    fn handshake(&self, groups: &Groups<'_>, tables: &Tables) -> Result<()> {
        let buffers = Fingerprints {
            mine: &tables.constants[MINE],
            theirs: &tables.constants[THEIRS],
        };
        groups.exchange_fingerprints(&self.peers, &buffers)?;
        if self.verify {
            groups.verify_fingerprints(&self.peers, self.gpu.program.fingerprint, &buffers)?;
        }
        Ok(())
    }

    /// The device of the call: the communicator's, which every buffer must be on.
    fn device_ordinal(
        &self,
        buffers: &CallBuffers<'_>,
        comm: NcclComm,
        nccl: Option<&Nccl>,
    ) -> Result<(i32, Option<deadline::Identity>)> {
        let p = &*self.gpu.program;
        let first = |list: &[usize]| list.iter().copied().find(|&x| x != 0).unwrap_or(0);
        let (send, recv) = match buffers {
            CallBuffers::Single { send, recv } => (*send, *recv),
            CallBuffers::PerTensor { send, recv } => (first(send), first(recv)),
        };
        let (mut device, mut identity) = (None, None);
        if let Some(nccl) = nccl {
            // A communicator the library aborted is gone: not even asked about.
            deadline::refuse_aborted(comm)?;
            let mut rank = -1;
            let mut count = -1;
            let mut dev = -1;
            // SAFETY: the caller passes a valid communicator; each call writes one int.
            unsafe {
                nccl.check(
                    (nccl.comm_user_rank)(comm, &mut rank),
                    "ncclCommUserRank",
                    comm,
                )?;
                nccl.check((nccl.comm_count)(comm, &mut count), "ncclCommCount", comm)?;
                nccl.check(
                    (nccl.comm_cu_device)(comm, &mut dev),
                    "ncclCommCuDevice",
                    comm,
                )?;
            }
            if rank != p.rank as i32 {
                return Err(Error::invalid_usage(format!(
                    "the plan was created for rank {} but comm's rank is {rank}; create each rank's plan with its own communicator rank",
                    p.rank
                )));
            }
            if let Some(&peer) = self
                .peers
                .last()
                .filter(|&&peer| peer as i64 >= count as i64)
            {
                return Err(Error::invalid_usage(format!(
                    "the plan exchanges data with rank {peer} but comm has only {count} ranks"
                )));
            }
            device = Some(dev);
            identity = Some((rank, count, dev));
        }
        for (ptr, name) in [(send, "sendbuff"), (recv, "recvbuff")] {
            if ptr == 0 {
                continue;
            }
            let on = driver::pointer_device(ptr, name)?;
            match device {
                None => device = Some(on),
                Some(d) if d != on => {
                    return Err(Error::invalid_argument(format!(
                        "{name} is on device {on} but comm (or the other buffer) is on device {d}"
                    )))
                }
                Some(_) => {}
            }
        }
        let device = device.ok_or_else(|| {
            Error::invalid_argument(
                "no buffer and no communicator: nothing tells which device to use",
            )
        })?;
        Ok((device, identity))
    }
}

/// The stream must belong to the device's primary context: the kernel is loaded there, and a
/// stream of another device or of a context made with `cuCtxCreate` cannot run it.
fn check_stream(stream: sys::CUstream, device: &Device) -> Result<()> {
    let context = driver::stream_context(stream)?;
    if context != device.context.context {
        return Err(Error::invalid_argument(format!(
            "stream ({stream:p}) belongs to a CUDA context other than device {}'s primary context, which the communicator and buffers use: pass a stream of that device created through the CUDA runtime (cudaStreamCreate after cudaSetDevice({}), as PyTorch and NCCL do), not one of another device or of a context made with cuCtxCreate",
            device.context.ordinal, device.context.ordinal
        )));
    }
    Ok(())
}

/// Whether the NCCL the library uses lets it see an open NCCL group without NCCL logging a
/// warning (its symbol table names the group depth; docs/executor.md, "Calls inside a
/// caller's group"); false also when no NCCL can be loaded.
pub fn group_depth_readable() -> bool {
    library::nccl().is_ok_and(|nccl| nccl.reads_group_depth())
}

/// The outcome of this rank's calls with a deadline on `comm`: `Ok(true)` once none is running
/// and none failed, `Ok(false)` while one is running, the failure (`ncclRemoteError`, saying
/// what did not complete, with which peers, and what to do next) once one failed.
pub fn comm_status(comm: *mut c_void) -> Result<bool> {
    deadline::status(comm)
}

/// Waits until none of this rank's calls with a deadline on `comm` is running (each ends by
/// its deadline plus the watchdog's tick and the revoke), then returns as [`comm_status`].
pub fn comm_wait(comm: *mut c_void) -> Result<()> {
    deadline::wait(comm)
}

/// Revokes `comm` now (the application learned a rank is dead): every operation pending on it
/// ends, its running calls fail, and nothing more may be posted on it (with an NCCL older than
/// 2.28.7 it is aborted instead, and gone).
///
/// # Safety
/// `comm` is NULL (where allowed) or a communicator of the process's NCCL, alive, and not in use
/// by another thread in a way NCCL forbids; `config` is NULL or an `ncclConfig_t`.
pub unsafe fn comm_revoke(comm: *mut c_void) -> Result<()> {
    if comm.is_null() {
        return Err(Error::invalid_argument("comm is NULL"));
    }
    deadline::revoke_now(library::nccl()?, comm)
}

/// `ncclCommShrink` of the process's NCCL (which must have it: 2.27.3 or newer), excluding
/// `exclude` (one rank or more, as NCCL requires; the same list on every survivor, which alone
/// call it); `abort`:
/// `NCCL_SHRINK_ABORT` (after a failure; required once the library revoked `comm`), else
/// `NCCL_SHRINK_DEFAULT`. `config` is NULL (the parent's) or an `ncclConfig_t`. Returns the
/// new communicator, on which this rank's rank is its old one less the excluded ranks below
/// it; the library then forgets `comm`.
///
/// # Safety
/// `comm` is NULL (where allowed) or a communicator of the process's NCCL, alive, and not in use
/// by another thread in a way NCCL forbids; `config` is NULL or an `ncclConfig_t`.
pub unsafe fn comm_shrink(
    comm: *mut c_void,
    exclude: &[i32],
    config: *mut c_void,
    abort: bool,
) -> Result<*mut c_void> {
    if comm.is_null() {
        return Err(Error::invalid_argument("comm is NULL"));
    }
    if exclude.is_empty() {
        // NCCL refuses it (a NULL list, a count of 0: ncclInvalidArgument) after its own
        // checks; said here with the way on.
        return Err(Error::invalid_argument(
            "excludeRanksCount is 0: ncclCommShrink must exclude at least one rank (NCCL refuses an empty excludeRanksList); list the failed ranks, or, when every rank is alive after a revoke, create a new communicator (ncclCommInitRank with a new unique id) and keep the revoked one until the end (docs/resilience.md)",
        ));
    }
    deadline::refuse_aborted(comm)?;
    let nccl = library::nccl()?;
    let shrink = nccl.require(nccl.comm_shrink, "ncclCommShrink", library::SHRINK_SINCE)?;
    let abort = abort || deadline::revoked(comm).is_some();
    let mut list = exclude.to_vec();
    let count = i32::try_from(list.len())
        .map_err(|_| Error::invalid_argument("too many ranks excluded"))?;
    let mut newcomm: *mut c_void = std::ptr::null_mut();
    // SAFETY: the caller's communicator; the list holds `count` ints; NCCL writes `newcomm`.
    let result = unsafe {
        shrink(
            comm,
            list.as_mut_ptr(),
            count,
            &mut newcomm,
            config,
            i32::from(abort),
        )
    };
    nccl.check_issued(result, "ncclCommShrink", newcomm)?;
    deadline::forget(comm);
    Ok(newcomm)
}

/// `ncclCommGetUniqueId` of the process's NCCL (2.29.2 or newer): the identifier the
/// coordinator of a grow hands to the new ranks.
///
/// # Safety
/// `comm` is NULL (where allowed) or a communicator of the process's NCCL, alive, and not in use
/// by another thread in a way NCCL forbids; `config` is NULL or an `ncclConfig_t`.
pub unsafe fn comm_get_unique_id(comm: *mut c_void) -> Result<[u8; 128]> {
    if comm.is_null() {
        return Err(Error::invalid_argument("comm is NULL"));
    }
    let nccl = library::nccl()?;
    let get = nccl.require(
        nccl.comm_get_unique_id,
        "ncclCommGetUniqueId",
        library::GROW_SINCE,
    )?;
    let mut id = library::UniqueId([0; 128]);
    // SAFETY: the caller's communicator; NCCL writes the identifier.
    nccl.check(unsafe { get(comm, &mut id) }, "ncclCommGetUniqueId", comm)?;
    Ok(id.0)
}

/// `ncclCommGrow` of the process's NCCL (2.29.2 or newer): an existing rank passes its `comm`,
/// `rank` -1 and (the coordinator only) `unique_id`; a new rank passes a NULL `comm`, the
/// coordinator's `unique_id` and its rank (from the parent's size on). Returns the grown
/// communicator.
///
/// # Safety
/// `comm` is NULL (where allowed) or a communicator of the process's NCCL, alive, and not in use
/// by another thread in a way NCCL forbids; `config` is NULL or an `ncclConfig_t`.
pub unsafe fn comm_grow(
    comm: *mut c_void,
    nranks: i32,
    unique_id: Option<&[u8; 128]>,
    rank: i32,
    config: *mut c_void,
) -> Result<*mut c_void> {
    let nccl = library::nccl()?;
    let grow = nccl.require(nccl.comm_grow, "ncclCommGrow", library::GROW_SINCE)?;
    let id = unique_id.map(|id| library::UniqueId(*id));
    let mut newcomm: *mut c_void = std::ptr::null_mut();
    // SAFETY: the caller's communicator (or NULL for a new rank); NCCL writes `newcomm`.
    let result = unsafe {
        grow(
            comm,
            nranks,
            id.as_ref()
                .map_or(std::ptr::null(), |id| id as *const library::UniqueId),
            rank,
            &mut newcomm,
            config,
        )
    };
    nccl.check_issued(result, "ncclCommGrow", newcomm)?;
    Ok(newcomm)
}

// Plans are shared across threads; the transport must be too.
const _: fn() = || {
    fn is<T: Send + Sync>() {}
    is::<NcclTransport>();
};
