//! Running one rank's program on a CUDA stream and an NCCL communicator.
//!
//! Per call: local copies and packs (one kernel launch per encoded launch), then every send and
//! receive inside `ncclGroupStart/End` (nested inside the caller's group when there is one),
//! then unpacks. The first call on a device compiles the kernel (cached per process), uploads
//! the plan's descriptor tables and allocates staging for the stream; later calls only pass
//! base pointers, so they allocate nothing, never synchronise and can be captured into a CUDA
//! graph (capture a stream that has already run the plan once).

use super::descriptors::{encode, Addressing, BaseKey, Encoded, Launch, MAX_BASES};
use super::driver::{self, DeviceBuffer, Kernel, PrimaryContext};
use super::libs;
use super::nccl::{nccl, Nccl, NcclComm, NCCL_UINT8};
use super::nvrtc;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::plan::{Copy, Loc, Message, RankProgram, Round};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Threads per block; must match `NCCL_RESHARD_THREADS` in kernels/copy.cu.
const THREADS: u32 = 256;
/// Most blocks one launch covers (the rest go to further launches).
const MAX_GRID: u64 = 1 << 30;
/// Default bound on staging per plan and stream (`NCCL_RESHARD_STAGING_BYTES` overrides it,
/// the config's `maxStagingBytes` overrides both).
pub const DEFAULT_MAX_STAGING_BYTES: u64 = 8 << 30;

/// Where this call's buffers are.
pub enum CallBuffers<'a> {
    /// `ncclReshard`: one source and one destination buffer; views at the plan's offsets.
    Single { send: usize, recv: usize },
    /// `ncclReshardMulti`: one pointer per tensor and side (0 where the rank has no view; an
    /// empty slice when the rank has no views on that side).
    PerTensor {
        send: &'a [usize],
        recv: &'a [usize],
    },
}

/// Descriptor tables of one phase, on the device.
struct Uploaded {
    launches: Vec<Launch>,
    descs: DeviceBuffer,
    tiles: DeviceBuffer,
}

impl Uploaded {
    fn new(encoded: Encoded) -> Result<Uploaded> {
        Ok(Uploaded {
            descs: DeviceBuffer::upload(&encoded.descs, "copy descriptors")?,
            tiles: DeviceBuffer::upload(&encoded.tiles, "copy tiles")?,
            launches: encoded.launches,
        })
    }
}

/// The plan's state on one device. Buffers are freed with the context current, before it is
/// released.
struct DeviceState {
    kernel: Option<Kernel>,
    /// Per round, (before the messages, after them), per addressing: single-buffer,
    /// per-tensor. Filled under `init` at the first call that needs them; read without
    /// locking after.
    single: OnceLock<Vec<(Uploaded, Uploaded)>>,
    per_tensor: OnceLock<Vec<(Uploaded, Uploaded)>>,
    init: Mutex<()>,
    /// Staging arena per stream (concurrent calls on different streams must not share it).
    staging: Mutex<HashMap<usize, Arc<DeviceBuffer>>>,
    context: PrimaryContext,
}

impl Drop for DeviceState {
    fn drop(&mut self) {
        let _current = self.context.push();
        self.kernel.take();
        drop(self.single.take());
        drop(self.per_tensor.take());
        if let Ok(mut staging) = self.staging.lock() {
            staging.clear();
        }
    }
}

/// Executes one rank's program on GPUs. Created with the plan (no CUDA calls); the first call
/// on a device initialises it.
pub struct CudaExecutor {
    program: Arc<RankProgram>,
    src_offsets: Vec<u64>,
    dst_offsets: Vec<u64>,
    /// The staging bound, resolved once from the config and the environment.
    max_staging_bytes: u64,
    /// The program's distinct peers, computed once (checked against the communicator's size
    /// on every call).
    peers: Vec<u32>,
    /// `NCCL_RESHARD_CHECK=1` (read at plan creation): compare plan fingerprints with every
    /// peer before moving data.
    check_peers: bool,
    device: Mutex<Option<Arc<DeviceState>>>,
}

fn staging_limit(configured: u64) -> u64 {
    if configured > 0 {
        return configured;
    }
    std::env::var("NCCL_RESHARD_STAGING_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&v| v > 0)
        .unwrap_or(DEFAULT_MAX_STAGING_BYTES)
}

impl CudaExecutor {
    /// `src_offsets`/`dst_offsets`: byte offsets of each tensor's views in the single-buffer
    /// call; `max_staging_bytes`: 0 for the default.
    pub fn new(
        program: Arc<RankProgram>,
        src_offsets: Vec<u64>,
        dst_offsets: Vec<u64>,
        max_staging_bytes: u64,
    ) -> Self {
        let peers = program.peers();
        CudaExecutor {
            program,
            src_offsets,
            dst_offsets,
            max_staging_bytes: staging_limit(max_staging_bytes),
            peers,
            check_peers: std::env::var("NCCL_RESHARD_CHECK").is_ok_and(|v| v.trim() == "1"),
            device: Mutex::new(None),
        }
    }

    /// Compares fingerprints with every peer before each call (default: `NCCL_RESHARD_CHECK`
    /// is `1` when the executor is created).
    pub fn with_peer_check(mut self, on: bool) -> Self {
        self.check_peers = on;
        self
    }

    /// `NCCL_RESHARD_CHECK=1`: sends this plan's fingerprint to every peer and receives
    /// theirs (one NCCL group on `stream`), waits, and fails naming the first peer whose plan
    /// differs. Synchronises the stream: not for graph capture or inside a user's group.
    fn check_fingerprints(&self, nccl: &Nccl, comm: NcclComm, stream: *mut c_void) -> Result<()> {
        let p = &*self.program;
        if driver::is_capturing(stream as sys::CUstream)? {
            return Err(Error::invalid_usage(
                "NCCL_RESHARD_CHECK=1 waits for the peers' fingerprints, which a CUDA graph capture cannot do; unset it while capturing",
            ));
        }
        let mine = DeviceBuffer::upload(&[p.fingerprint], "plan fingerprint")?;
        let theirs = DeviceBuffer::alloc(8 * self.peers.len(), "peer fingerprints")?;
        // SAFETY: group calls have no preconditions; every Start is matched by an End below.
        nccl.check(unsafe { (nccl.group_start)() }, "ncclGroupStart", comm)?;
        let posted = self.peers.iter().enumerate().try_for_each(|(i, &peer)| {
            let slot = (theirs.ptr + 8 * i as u64) as *mut c_void;
            // SAFETY: both buffers are ours, 8 bytes per peer, alive until the wait below.
            unsafe {
                nccl.check(
                    (nccl.send)(
                        mine.ptr as *mut c_void,
                        8,
                        NCCL_UINT8,
                        peer as i32,
                        comm,
                        stream,
                    ),
                    "ncclSend (fingerprint)",
                    comm,
                )?;
                nccl.check(
                    (nccl.recv)(slot, 8, NCCL_UINT8, peer as i32, comm, stream),
                    "ncclRecv (fingerprint)",
                    comm,
                )
            }
        });
        // SAFETY: closes the group opened above.
        let ended = nccl.check(unsafe { (nccl.group_end)() }, "ncclGroupEnd", comm);
        posted.and(ended)?;
        let mut fingerprints = vec![0u64; self.peers.len()];
        theirs.download(&mut fingerprints, stream as sys::CUstream)?;
        for (&peer, &theirs) in self.peers.iter().zip(&fingerprints) {
            if theirs != p.fingerprint {
                return Err(Error::invalid_usage(format!(
                    "rank {peer} created its plan from different tensors or config than rank {} (fingerprint {theirs:#018x} vs {:#018x}); every rank must pass the same descriptors and config",
                    p.rank, p.fingerprint
                )));
            }
        }
        debug::log(Level::Info, || {
            format!(
                "rank {}: NCCL_RESHARD_CHECK: {} peer(s) planned the same ({:#018x})",
                p.rank,
                self.peers.len(),
                p.fingerprint
            )
        });
        Ok(())
    }

    fn addressing(&self, buffers: &CallBuffers<'_>) -> Addressing<'_> {
        match buffers {
            CallBuffers::Single { .. } => Addressing::Single {
                src_offsets: &self.src_offsets,
                dst_offsets: &self.dst_offsets,
            },
            CallBuffers::PerTensor { .. } => Addressing::PerTensor,
        }
    }

    /// Enqueues the program on `stream` with `comm`. See the module documentation.
    pub fn execute(
        &self,
        buffers: &CallBuffers<'_>,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        let p = &*self.program;
        if p.is_empty() {
            return Ok(());
        }
        let limit = self.max_staging_bytes;
        if p.staging_bytes > limit {
            return Err(Error::invalid_usage(format!(
                "the plan needs {} bytes of staging on rank {} (its largest round) but the limit is {limit}; raise config.rounds (more, smaller rounds), config.maxStagingBytes or NCCL_RESHARD_STAGING_BYTES, or plan in groupable mode",
                p.staging_bytes, p.rank
            )));
        }
        let messages = !(p.sends.is_empty() && p.recvs.is_empty());
        if messages && comm.is_null() {
            return Err(Error::invalid_argument(format!(
                "comm is NULL but rank {} exchanges data with {} peer(s)",
                p.rank,
                self.peers.len()
            )));
        }
        libs::driver()?;
        let nccl = if messages { Some(nccl()?) } else { None };
        let ordinal = self.device_ordinal(buffers, comm, nccl)?;
        let state = self.device_state(ordinal, stream)?;
        let _current = state.context.push()?;
        let stream_key = stream as usize;
        let staging = self.staging(&state, stream_key, stream)?;
        let addressing = self.addressing(buffers);
        let tables = match buffers {
            CallBuffers::Single { .. } => &state.single,
            CallBuffers::PerTensor { .. } => &state.per_tensor,
        };
        if tables.get().is_none() {
            let _init = state
                .init
                .lock()
                .map_err(|_| Error::internal("executor lock poisoned"))?;
            if tables.get().is_none() {
                if driver::is_capturing(stream as sys::CUstream)? {
                    return Err(warm_up_error());
                }
                // Local copies run with the first round's packs.
                let mut built = Vec::new();
                for (i, round) in p.rounds().iter().enumerate() {
                    let local: &[Copy] = if i == 0 { &p.local_copies } else { &[] };
                    let pre: Vec<Copy> = local.iter().chain(round.packs).cloned().collect();
                    built.push((
                        Uploaded::new(encode(&pre, addressing))?,
                        Uploaded::new(encode(round.unpacks, addressing))?,
                    ));
                }
                let _ = tables.set(built);
            }
        }
        let tables = tables
            .get()
            .ok_or_else(|| Error::internal("descriptor tables missing"))?;
        let kernel = state
            .kernel
            .as_ref()
            .ok_or_else(|| Error::internal("kernel not loaded"))?;
        let base = |key: BaseKey| -> u64 { resolve_base(key, buffers, staging.ptr) };

        debug::log(Level::Info, || {
            format!(
                "rank {}: {} round(s), {} local copy/pack blocks, {} sends ({} bytes), {} receives ({} bytes), {} unpack blocks, stream {stream:p}",
                p.rank,
                p.rounds_iter().count(),
                p.local_copies.len() + p.packs.len(),
                p.sends.len(),
                p.bytes_sent(),
                p.recvs.len(),
                p.bytes_received(),
                p.unpacks.len()
            )
        });
        if self.check_peers {
            if let Some(nccl) = nccl {
                self.check_fingerprints(nccl, comm, stream)?;
            }
        }
        // Each round: packs, one NCCL group, unpacks, all in stream order, so the staging
        // arena is reused by the next round only once this one has finished with it.
        for (round, (before, after)) in p.rounds_iter().zip(tables) {
            launch_all(kernel, before, &base, stream)?;
            if let Some(nccl) = nccl {
                post_messages(nccl, p.rank, &round, &addressing, &base, comm, stream)?;
            }
            launch_all(kernel, after, &base, stream)?;
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
        let p = &*self.program;
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

    /// The plan's state on `ordinal`, initialised by the first call.
    fn device_state(&self, ordinal: i32, stream: *mut c_void) -> Result<Arc<DeviceState>> {
        let mut slot = self
            .device
            .lock()
            .map_err(|_| Error::internal("executor lock poisoned"))?;
        if let Some(state) = slot.as_ref() {
            if state.context.ordinal != ordinal {
                return Err(Error::invalid_usage(format!(
                    "the plan runs on device {} but this call's buffers are on device {ordinal}; create one plan per device",
                    state.context.ordinal
                )));
            }
            return Ok(state.clone());
        }
        if driver::is_capturing(stream as sys::CUstream)? {
            return Err(warm_up_error());
        }
        let context = PrimaryContext::retain(ordinal)?;
        let (major, minor) = context.compute_capability()?;
        let cubin = nvrtc::cubin(major, minor)?;
        let kernel = {
            let _current = context.push()?;
            Kernel::load(&cubin, nvrtc::KERNEL_NAME)?
        };
        let state = Arc::new(DeviceState {
            kernel: Some(kernel),
            single: OnceLock::new(),
            per_tensor: OnceLock::new(),
            init: Mutex::new(()),
            staging: Mutex::new(HashMap::new()),
            context,
        });
        *slot = Some(state.clone());
        Ok(state)
    }

    /// This stream's staging arena (allocated on its first call).
    fn staging(
        &self,
        state: &DeviceState,
        key: usize,
        stream: *mut c_void,
    ) -> Result<Arc<DeviceBuffer>> {
        let mut map = state
            .staging
            .lock()
            .map_err(|_| Error::internal("staging lock poisoned"))?;
        if let Some(buffer) = map.get(&key) {
            return Ok(buffer.clone());
        }
        if driver::is_capturing(stream as sys::CUstream)? {
            return Err(warm_up_error());
        }
        let bytes = usize::try_from(self.program.staging_bytes)
            .map_err(|_| Error::invalid_usage("staging does not fit the address space"))?;
        let buffer = Arc::new(DeviceBuffer::alloc(bytes, "staging")?);
        map.insert(key, buffer.clone());
        Ok(buffer)
    }
}

fn warm_up_error() -> Error {
    Error::invalid_usage(
        "ncclReshard was first called on this device/stream while the stream is being captured: run the plan once on that stream before capturing it (the first call compiles kernels and allocates)",
    )
}

fn resolve_base(key: BaseKey, buffers: &CallBuffers<'_>, staging: u64) -> u64 {
    match (key, buffers) {
        (BaseKey::Staging, _) => staging,
        (BaseKey::SendBuffer, CallBuffers::Single { send, .. }) => *send as u64,
        (BaseKey::RecvBuffer, CallBuffers::Single { recv, .. }) => *recv as u64,
        (BaseKey::SrcTensor(t), CallBuffers::PerTensor { send, .. }) => {
            send.get(t as usize).copied().unwrap_or(0) as u64
        }
        (BaseKey::DstTensor(t), CallBuffers::PerTensor { recv, .. }) => {
            recv.get(t as usize).copied().unwrap_or(0) as u64
        }
        // An encoding always matches its addressing.
        _ => 0,
    }
}

/// The address of a program location in this call.
fn address(loc: Loc, addressing: &Addressing<'_>, base: &impl Fn(BaseKey) -> u64) -> u64 {
    let (key, offset) = addressing.resolve(loc);
    base(key) + offset
}

#[repr(C)]
struct Bases([u64; MAX_BASES]);

fn launch_all(
    kernel: &Kernel,
    tables: &Uploaded,
    base: &impl Fn(BaseKey) -> u64,
    stream: *mut c_void,
) -> Result<()> {
    for launch in &tables.launches {
        let mut bases = Bases([0; MAX_BASES]);
        for (slot, &key) in launch.bases.iter().enumerate() {
            bases.0[slot] = base(key);
        }
        let mut done = 0;
        while done < launch.tiles {
            let blocks = (launch.tiles - done).min(MAX_GRID);
            let mut descs = tables.descs.ptr;
            let mut tiles = tables.tiles.ptr;
            let mut first = launch.first_tile + done;
            let mut params: [*mut c_void; 4] = [
                (&mut descs as *mut u64).cast(),
                (&mut tiles as *mut u64).cast(),
                (&mut first as *mut u64).cast(),
                (&mut bases as *mut Bases).cast(),
            ];
            // SAFETY: the kernel's parameters are (const CopyDesc*, const Tile*, u64, Bases),
            // matching `params`; the tables stay alive while the plan does.
            driver::call("cuLaunchKernel", || unsafe {
                sys::cuLaunchKernel(
                    kernel.function,
                    blocks as u32,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream as sys::CUstream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })?;
            done += blocks;
        }
    }
    Ok(())
}

fn post_messages(
    nccl: &Nccl,
    rank: u32,
    round: &Round<'_>,
    addressing: &Addressing<'_>,
    base: &impl Fn(BaseKey) -> u64,
    comm: NcclComm,
    stream: *mut c_void,
) -> Result<()> {
    if round.sends.is_empty() && round.recvs.is_empty() {
        return Ok(());
    }
    // SAFETY: group calls have no preconditions; every Start is matched by an End below.
    nccl.check(unsafe { (nccl.group_start)() }, "ncclGroupStart", comm)?;
    let post = |m: &Message, send: bool| -> Result<()> {
        let ptr = address(m.loc, addressing, base) as *mut c_void;
        debug::log(Level::Trace, || {
            format!(
                "rank {rank} round {} {} {} bytes {} rank {} at {ptr:p}",
                round.round,
                if send { "sends" } else { "receives" },
                m.bytes,
                if send { "to" } else { "from" },
                m.peer
            )
        });
        let bytes =
            usize::try_from(m.bytes).map_err(|_| Error::invalid_usage("message too large"))?;
        // SAFETY: ptr addresses `bytes` bytes inside the caller's buffers or our staging, per
        // the plan; NCCL reads/writes them in stream order.
        let result = unsafe {
            if send {
                (nccl.send)(ptr, bytes, NCCL_UINT8, m.peer as i32, comm, stream)
            } else {
                (nccl.recv)(ptr, bytes, NCCL_UINT8, m.peer as i32, comm, stream)
            }
        };
        nccl.check(result, if send { "ncclSend" } else { "ncclRecv" }, comm)
    };
    let posted = round
        .sends
        .iter()
        .try_for_each(|m| post(m, true))
        .and_then(|()| round.recvs.iter().try_for_each(|m| post(m, false)));
    // SAFETY: closes the group opened above, also after an error so NCCL's state stays sane.
    let ended = nccl.check(unsafe { (nccl.group_end)() }, "ncclGroupEnd", comm);
    posted.and(ended)
}

// Plans are shared across threads; the executor must be too.
const _: fn() = || {
    fn is<T: Send + Sync>() {}
    is::<CudaExecutor>();
};
