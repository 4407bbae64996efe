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

mod groups;
pub(crate) mod library;

use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::buffers::CallBuffers;
use crate::exec::{schedule, Limits, Plan};
use crate::gpu::{driver, Device, DeviceCall, DeviceLimits, DeviceProgram, Tables};
use crate::plan::{Mode, RankProgram};
use cudarc::driver::sys;
use groups::{Fingerprints, Groups};
use library::{Nccl, NcclComm};
use std::ffi::c_void;
use std::sync::Arc;

/// Runs one rank's program on GPUs with NCCL. Created with the plan (no CUDA calls); the first
/// call initialises it on the call's device. Shareable across threads: calls on different
/// streams and communicators may run at once.
pub struct NcclTransport {
    gpu: DeviceProgram,
    /// The program's distinct peers, ascending (checked against the communicator's size on
    /// every call; fingerprint slots follow this order).
    peers: Vec<u32>,
    /// The plan was made in groupable mode: it may be called inside a caller's NCCL group.
    /// Plan-wide (the config's mode), so every rank decides the same.
    groupable: bool,
    /// `NCCL_RESHARD_CHECK=1` when the plan was created: each call waits for the peers'
    /// fingerprints and compares them before moving data.
    verify: bool,
}

/// Indices of the fingerprint buffers in the program's device constants.
const MINE: usize = 0;
const THEIRS: usize = 1;

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
        let constants = vec![vec![program.fingerprint], vec![0u64; peers.len()]];
        NcclTransport {
            gpu: DeviceProgram::new(program, src_offsets, dst_offsets, constants),
            peers,
            groupable,
            verify: std::env::var("NCCL_RESHARD_CHECK").is_ok_and(|v| v.trim() == "1"),
        }
    }

    /// The transport of `plan`'s program, with its views' offsets in the single-buffer call.
    pub fn for_plan(plan: &Plan) -> Self {
        let views = plan.views();
        NcclTransport::new(
            plan.program().clone(),
            views.src_offsets(),
            views.dst_offsets(),
            plan.mode() == Mode::Groupable,
        )
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
        let p = &*self.gpu.program;
        if p.is_empty() {
            return Ok(());
        }
        // What the call runs on.
        let messages = !(p.sends.is_empty() && p.recvs.is_empty());
        if messages && comm.is_null() {
            return Err(Error::invalid_argument(format!(
                "comm is NULL but rank {} exchanges data with {} peer(s)",
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
        let ordinal = self.device_ordinal(buffers, comm, nccl)?;
        let state = self.gpu.on_device(ordinal)?;
        let device = &*state.device;
        let _current = device.context.push()?;
        let cu_stream = stream as sys::CUstream;
        check_stream(cu_stream, device)?;
        let capturing = driver::is_capturing(cu_stream)?;
        // Warm-up on the first call.
        let tables = self.gpu.tables(&state, capturing)?;
        // What the caller's group or capture does not allow.
        if let Some(nccl) = nccl {
            self.refuse(nccl, capturing)?;
        }
        // What the call takes, then the first NCCL operation: the fingerprints.
        let groups = nccl.map(|nccl| Groups {
            nccl,
            comm,
            stream: cu_stream,
            rank: p.rank,
        });
        let mut call = DeviceCall::begin(
            device, &self.gpu, tables, buffers, cu_stream, capturing, groups,
        )?;
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
                return Err(e);
            }
        }
        // The walk, then what the call took goes back (the walk's error first).
        let walked = schedule::run(p, &mut call);
        let finished = call.finish();
        walked.and(finished)
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
    ) -> Result<i32> {
        let p = &*self.gpu.program;
        let first = |list: &[usize]| list.iter().copied().find(|&x| x != 0).unwrap_or(0);
        let (send, recv) = match buffers {
            CallBuffers::Single { send, recv } => (*send, *recv),
            CallBuffers::PerTensor { send, recv } => (first(send), first(recv)),
        };
        let mut device = None;
        if let Some(nccl) = nccl {
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
        device.ok_or_else(|| {
            Error::invalid_argument(
                "no buffer and no communicator: nothing tells which device to use",
            )
        })
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

// Plans are shared across threads; the transport must be too.
const _: fn() = || {
    fn is<T: Send + Sync>() {}
    is::<NcclTransport>();
};
