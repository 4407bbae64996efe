//! Running one rank's program on a CUDA stream and an NCCL communicator (docs/executor.md).
//!
//! A call: checks (communicator, buffers, stream, an open NCCL group where the plan may not be
//! in one), then per round the round's packs (local copies before the first), one NCCL group of
//! its sends and receives, its unpacks, all enqueued on the caller's stream; staging comes from
//! a stream-ordered pool for the call and goes back at its end. The first call of a plan on a
//! device (warm-up) compiles and loads the kernel and uploads the descriptor tables; later
//! calls only pass pointers as kernel arguments, so they can be captured into a CUDA graph.

use super::descriptors::{
    convert_tables, encode, encode_converts, Addressing, BaseKey, ConvertPasses, Encoded, Launch,
    MAX_BASES,
};
use super::device::{self, Device, SideStream};
use super::driver::{self, DeviceBuffer, Event, Kernel, PrivateStream, RelaxedCapture};
use super::libs;
use super::nccl::{nccl, Nccl, NcclComm, NCCL_UINT8};
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::buffers::CallBuffers;
use crate::plan::{Loc, Message, RankProgram, Round, StridedCopy};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Threads per block; must match `NCCL_RESHARD_THREADS` in kernels/copy.cu.
const THREADS: u32 = 256;
/// Most blocks one launch covers (the rest go to further launches).
const MAX_GRID: u64 = 1 << 30;
/// Default for how long `NCCL_RESHARD_CHECK=1` waits for the peers' fingerprints
/// (`NCCL_RESHARD_CHECK_TIMEOUT`, seconds).
const CHECK_TIMEOUT_SECONDS: u64 = 300;

/// Descriptor tables of one phase, on the device.
struct Uploaded {
    launches: Vec<Launch>,
    descs: DeviceBuffer,
    tiles: DeviceBuffer,
}

/// One round's tables: its packs (with the local copies in the first round), the unpacks
/// that finish before the next round, and the late ones.
struct RoundTables {
    before: Uploaded,
    early: Uploaded,
    late: Uploaded,
}

/// The tables of one addressing (single-buffer or per-tensor call): the conversions before
/// the rounds (three passes), per round its tables, and the conversions after the rounds.
struct Phases {
    converts_before: Vec<Uploaded>,
    rounds: Vec<RoundTables>,
    converts_after: Vec<Uploaded>,
}

/// What warm-up puts on the device for one plan: its tables for both ways of passing buffers
/// (so a later call of either kind needs no upload, also during a capture), and the
/// fingerprint buffers.
struct Tables {
    single: Phases,
    per_tensor: Phases,
    /// This plan's fingerprint (8 bytes), sent to every peer.
    mine: DeviceBuffer,
    /// One 8-byte slot per peer (in `peers` order) for theirs.
    theirs: DeviceBuffer,
}

/// A plan's state on its device. Dropped with the plan, with the context current.
struct PlanDevice {
    device: Arc<Device>,
    tables: OnceLock<Tables>,
    init: Mutex<()>,
}

impl Drop for PlanDevice {
    fn drop(&mut self) {
        let _current = self.device.context.push();
        drop(self.tables.take());
        if let Some(pool) = self.device.existing_pool() {
            pool.trim();
        }
    }
}

/// Executes one rank's program on GPUs. Created with the plan (no CUDA calls); the first call
/// initialises it on the call's device.
pub struct CudaExecutor {
    program: Arc<RankProgram>,
    src_offsets: Vec<u64>,
    dst_offsets: Vec<u64>,
    /// The program's distinct peers, ascending (checked against the communicator's size on
    /// every call; fingerprint slots follow this order).
    peers: Vec<u32>,
    /// Bytes of conversion scratch (segment amaxes, block divisors) the conversions address.
    scratch_bytes: u64,
    /// The plan was made in groupable mode: it may be called inside a caller's NCCL group.
    /// Plan-wide (the config's mode), so every rank decides the same.
    groupable: bool,
    /// `NCCL_RESHARD_CHECK=1` when the plan was created: each call waits for the peers'
    /// fingerprints and compares them before moving data.
    verify: bool,
    state: Mutex<Option<Arc<PlanDevice>>>,
}

impl CudaExecutor {
    /// `src_offsets`/`dst_offsets`: byte offsets of each tensor's views in the single-buffer
    /// call; `groupable`: the plan was created in groupable mode.
    pub fn new(
        program: Arc<RankProgram>,
        src_offsets: Vec<u64>,
        dst_offsets: Vec<u64>,
        groupable: bool,
    ) -> Self {
        let peers = program.peers();
        let scratch_bytes = [&program.converts_before, &program.converts_after]
            .iter()
            .map(|c| convert_tables(c).0)
            .max()
            .unwrap_or(0);
        CudaExecutor {
            program,
            scratch_bytes,
            src_offsets,
            dst_offsets,
            peers,
            groupable,
            verify: std::env::var("NCCL_RESHARD_CHECK").is_ok_and(|v| v.trim() == "1"),
            state: Mutex::new(None),
        }
    }

    /// Waits for and compares the peers' fingerprints on every call (default:
    /// `NCCL_RESHARD_CHECK` is `1` when the executor is created).
    pub fn with_peer_check(mut self, on: bool) -> Self {
        self.verify = on;
        self
    }

    fn addressing(&self, buffers: &CallBuffers<'_>) -> Addressing<'_> {
        match buffers {
            CallBuffers::Single { .. } => self.single_addressing(),
            CallBuffers::PerTensor { .. } => Addressing::PerTensor,
        }
    }

    fn single_addressing(&self) -> Addressing<'_> {
        Addressing::Single {
            src_offsets: &self.src_offsets,
            dst_offsets: &self.dst_offsets,
        }
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
        let p = &*self.program;
        if p.is_empty() {
            return Ok(());
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
        let state = self.plan_device(ordinal)?;
        let device = &*state.device;
        let _current = device.context.push()?;
        let cu_stream = stream as sys::CUstream;
        check_stream(cu_stream, device)?;
        let capturing = driver::is_capturing(cu_stream)?;
        let tables = match state.tables.get() {
            Some(tables) => tables,
            None if capturing => return Err(warm_up_error()),
            None => self.warm_up(&state)?,
        };
        let kernel = device.kernel()?;

        // Everything that can refuse the call does so before its first NCCL operation, and
        // decides from plan-wide facts, so every rank refuses alike.
        if let Some(nccl) = nccl {
            if !self.groupable {
                nccl.refuse_open_group(|| {
                    format!(
                        "rank {}: this plan was not created in groupable mode, so it must not be called inside ncclGroupStart/ncclGroupEnd (its packs, unpacks or rounds need its NCCL operations issued at once); call it outside the group, or create the plan with mode ncclReshardModeGroupable",
                        p.rank
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
                            "rank {}: NCCL_RESHARD_CHECK=1 waits for the peers' fingerprints, which cannot arrive while the caller's NCCL group is open; unset it or call outside the group",
                            p.rank
                        )
                    })?;
                }
            }
            // Every call of every rank, whatever its environment, exchanges fingerprints with
            // each peer in a group of their own ahead of any data, so the messages between two
            // ranks always pair up and no fingerprint waits behind another peer's data in
            // NCCL's queues; only NCCL_RESHARD_CHECK=1 waits for them.
            self.exchange_fingerprints(nccl, comm, cu_stream, tables)?;
            if self.verify {
                self.verify_fingerprints(cu_stream, tables)?;
            }
        }

        let arena = self.arena();
        let pool = if arena.total > 0 {
            Some(device.pool()?)
        } else {
            None
        };
        let staging = match pool {
            Some(pool) => {
                let bytes = usize::try_from(arena.total)
                    .map_err(|_| Error::invalid_usage("staging does not fit the address space"))?;
                pool.alloc(bytes, cu_stream)?
            }
            None => 0,
        };
        let addressing = self.addressing(buffers);
        let phases = match buffers {
            CallBuffers::Single { .. } => &tables.single,
            CallBuffers::PerTensor { .. } => &tables.per_tensor,
        };
        let base = |key: BaseKey| -> u64 { resolve_base(key, buffers, staging, &arena) };
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

        // Each round: packs, one NCCL group, unpacks, in stream order, so the staging of one
        // round is reused by the next only once this one is done with it. Once the first NCCL
        // operation is posted, a failure no longer stops the call: the remaining groups are
        // still posted (their data may be wrong) so that no peer waits forever, and the first
        // error is returned at the end.
        //
        // Late unpacks (none read by a later round; their staging is theirs until the round
        // after next) run on a side stream beside the next round: forked after their round's
        // group, joined before the round after next posts its group (it reuses their arena)
        // and before the call ends. During a capture they stay on the caller's stream, in
        // order: a stream that joined a capture belongs to it until the capture ends, so it
        // could not serve another call meanwhile.
        let mut failure: Option<Error> = None;
        let late = p.has_late_unpacks() && !capturing;
        let side = if late {
            match device.side_stream() {
                Ok(side) => Some(side),
                Err(e) => {
                    failure = Some(e);
                    None
                }
            }
        } else {
            None
        };
        // Per arena parity: the side stream has late unpacks reading it that the caller's
        // stream has not yet waited for.
        let mut pending = [false; 2];
        let join = |parity: usize, pending: &mut [bool; 2], failure: &mut Option<Error>| {
            if let (Some(side), true) = (&side, pending[parity]) {
                pending[parity] = false;
                if let Err(e) = side.done[parity].wait_on(cu_stream) {
                    failure.get_or_insert(e);
                }
            }
        };
        for pass in &phases.converts_before {
            if failure.is_none() {
                failure = launch_all(kernel, pass, &base, cu_stream).err();
            }
        }
        for (k, (round, tables)) in p.rounds_iter().zip(&phases.rounds).enumerate() {
            if failure.is_none() {
                failure = launch_all(kernel, &tables.before, &base, cu_stream).err();
            }
            join(k % 2, &mut pending, &mut failure);
            if let Some(nccl) = nccl {
                let posted = self.post_round(nccl, &round, &addressing, &base, comm, stream);
                if let Err(e) = posted {
                    failure.get_or_insert(e);
                }
            }
            if round.late > 0 {
                match (&side, failure.is_none()) {
                    (Some(side), true) => {
                        failure = self
                            .fork_late(kernel, &tables.late, &base, cu_stream, side, k % 2)
                            .err();
                        pending[k % 2] = true;
                    }
                    (None, true) => {
                        failure = launch_all(kernel, &tables.late, &base, cu_stream).err();
                    }
                    _ => {}
                }
            }
            if failure.is_none() {
                failure = launch_all(kernel, &tables.early, &base, cu_stream).err();
            }
        }
        join(0, &mut pending, &mut failure);
        join(1, &mut pending, &mut failure);
        if let Some(side) = side {
            device.give_back(side);
        }
        for pass in &phases.converts_after {
            if failure.is_none() {
                failure = launch_all(kernel, pass, &base, cu_stream).err();
            }
        }
        if let Some(pool) = pool {
            if let Err(e) = pool.free(staging, cu_stream) {
                failure.get_or_insert(e);
            }
        }
        failure.map_or(Ok(()), Err)
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

    /// The plan's state on `ordinal` (one device per plan).
    fn plan_device(&self, ordinal: i32) -> Result<Arc<PlanDevice>> {
        let mut slot = self
            .state
            .lock()
            .map_err(|_| Error::internal("executor lock poisoned"))?;
        if let Some(state) = slot.as_ref() {
            if state.device.context.ordinal != ordinal {
                return Err(Error::invalid_usage(format!(
                    "the plan runs on device {} but this call's communicator or buffers are on device {ordinal}; create one plan per device",
                    state.device.context.ordinal
                )));
            }
            return Ok(state.clone());
        }
        let state = Arc::new(PlanDevice {
            device: device::device(ordinal)?,
            tables: OnceLock::new(),
            init: Mutex::new(()),
        });
        *slot = Some(state.clone());
        Ok(state)
    }

    /// The first call on the device (not capturing; context current): loads the kernel,
    /// creates the staging pool, uploads the tables and waits for the upload, with this
    /// thread's capture mode relaxed so another thread's capture is not disturbed.
    fn warm_up<'s>(&self, state: &'s PlanDevice) -> Result<&'s Tables> {
        let _init = state
            .init
            .lock()
            .map_err(|_| Error::internal("executor lock poisoned"))?;
        if let Some(tables) = state.tables.get() {
            return Ok(tables);
        }
        let p = &*self.program;
        let _relaxed = RelaxedCapture::new()?;
        state.device.kernel()?;
        if self.arena().total > 0 {
            state.device.pool()?;
        }
        let upload = PrivateStream::new()?;
        let one = |e: &Encoded| -> Result<Uploaded> {
            Ok(Uploaded {
                descs: DeviceBuffer::upload(&e.descs, "copy descriptors", &upload)?,
                tiles: DeviceBuffer::upload(&e.tiles, "copy tiles", &upload)?,
                launches: e.launches.clone(),
            })
        };
        let passes = |c: ConvertPasses| -> Result<Vec<Uploaded>> {
            c.passes.iter().filter(|e| !e.is_empty()).map(one).collect()
        };
        // Local copies run with the first round's packs.
        let phases = |addressing: Addressing<'_>| -> Result<Phases> {
            let rounds = p
                .rounds_iter()
                .enumerate()
                .map(|(i, round)| {
                    let local: &[StridedCopy] = if i == 0 { &p.local_copies } else { &[] };
                    let pre: Vec<StridedCopy> = local.iter().chain(round.packs).cloned().collect();
                    Ok(RoundTables {
                        before: one(&encode(&pre, addressing))?,
                        early: one(&encode(round.early_unpacks(), addressing))?,
                        late: one(&encode(round.late_unpacks(), addressing))?,
                    })
                })
                .collect::<Result<_>>()?;
            Ok(Phases {
                converts_before: passes(encode_converts(&p.converts_before, addressing))?,
                rounds,
                converts_after: passes(encode_converts(&p.converts_after, addressing))?,
            })
        };
        let zeros = vec![0u64; self.peers.len()];
        let tables = Tables {
            single: phases(self.single_addressing())?,
            per_tensor: phases(Addressing::PerTensor)?,
            mine: DeviceBuffer::upload(&[p.fingerprint], "plan fingerprint", &upload)?,
            theirs: DeviceBuffer::upload(&zeros, "peer fingerprints", &upload)?,
        };
        // The host vectors above stay alive until the copies have landed.
        upload.synchronize()?;
        Ok(state.tables.get_or_init(|| tables))
    }

    /// Runs `late` on the side stream once the caller's stream has passed this point (the
    /// round's group), and marks its end in `side.done[parity]`.
    fn fork_late(
        &self,
        kernel: &Kernel,
        late: &Uploaded,
        base: &impl Fn(BaseKey) -> u64,
        stream: sys::CUstream,
        side: &SideStream,
        parity: usize,
    ) -> Result<()> {
        side.fork.record(stream)?;
        side.fork.wait_on(side.stream.0)?;
        let launched = launch_all(kernel, late, base, side.stream.0);
        side.done[parity].record(side.stream.0)?;
        launched
    }

    /// One round's NCCL group: this rank's sends and receives.
    fn post_round(
        &self,
        nccl: &Nccl,
        round: &Round<'_>,
        addressing: &Addressing<'_>,
        base: &impl Fn(BaseKey) -> u64,
        comm: NcclComm,
        stream: *mut c_void,
    ) -> Result<()> {
        if round.sends.is_empty() && round.recvs.is_empty() {
            return Ok(());
        }
        let rank = self.program.rank;
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
            // SAFETY: ptr addresses `bytes` bytes inside the caller's buffers or our staging,
            // per the plan; NCCL reads/writes them in stream order.
            let result = unsafe {
                if send {
                    (nccl.send)(ptr, bytes, NCCL_UINT8, m.peer as i32, comm, stream)
                } else {
                    (nccl.recv)(ptr, bytes, NCCL_UINT8, m.peer as i32, comm, stream)
                }
            };
            nccl.check_posted(result, if send { "ncclSend" } else { "ncclRecv" }, comm)
        };
        let posted = round
            .sends
            .iter()
            .try_for_each(|m| post(m, true))
            .and_then(|()| round.recvs.iter().try_for_each(|m| post(m, false)));
        // SAFETY: closes the group opened above, also after an error so NCCL's state stays
        // sane; a nonblocking communicator is waited for before anything else is enqueued.
        let ended = nccl.check_issued(unsafe { (nccl.group_end)() }, "ncclGroupEnd", comm);
        posted.and(ended)
    }

    /// One NCCL group with, per peer, our fingerprint's send and the receive of theirs into
    /// its slot.
    fn exchange_fingerprints(
        &self,
        nccl: &Nccl,
        comm: NcclComm,
        stream: sys::CUstream,
        tables: &Tables,
    ) -> Result<()> {
        // SAFETY: group calls have no preconditions; the Start is matched by the End below.
        nccl.check(unsafe { (nccl.group_start)() }, "ncclGroupStart", comm)?;
        let posted = self.peers.iter().enumerate().try_for_each(|(i, &peer)| {
            let slot = (tables.theirs.ptr + 8 * i as u64) as *mut c_void;
            let mine = tables.mine.ptr as *mut c_void;
            // SAFETY: both buffers are the plan's, 8 bytes per slot, alive as long as the plan
            // (the caller must not destroy it before the stream passes this call).
            unsafe {
                nccl.check_posted(
                    (nccl.send)(mine, 8, NCCL_UINT8, peer as i32, comm, stream.cast()),
                    "ncclSend (fingerprint)",
                    comm,
                )?;
                nccl.check_posted(
                    (nccl.recv)(slot, 8, NCCL_UINT8, peer as i32, comm, stream.cast()),
                    "ncclRecv (fingerprint)",
                    comm,
                )
            }
        });
        // SAFETY: closes the group opened above.
        let ended = nccl.check_issued(unsafe { (nccl.group_end)() }, "ncclGroupEnd", comm);
        posted.and(ended)
    }

    /// `NCCL_RESHARD_CHECK=1`: waits for the fingerprints just exchanged (at most
    /// `NCCL_RESHARD_CHECK_TIMEOUT` seconds) and fails naming the first peer whose plan
    /// differs, before any data moves. The caller made sure no NCCL group is open and the
    /// stream is not being captured.
    fn verify_fingerprints(&self, stream: sys::CUstream, tables: &Tables) -> Result<()> {
        let p = &*self.program;
        let arrived = Event::new()?;
        arrived.record(stream)?;
        let timeout = std::env::var("NCCL_RESHARD_CHECK_TIMEOUT")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(CHECK_TIMEOUT_SECONDS);
        let start = Instant::now();
        while !arrived.is_done()? {
            if start.elapsed() > Duration::from_secs(timeout) {
                return Err(Error::invalid_usage(format!(
                    "rank {}: NCCL_RESHARD_CHECK=1: the fingerprints of peers {:?} did not arrive within {timeout} s (NCCL_RESHARD_CHECK_TIMEOUT); a peer does not call this plan, or planned a different set of peers; the communicator may now hold unmatched operations",
                    p.rank, self.peers
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut fingerprints = vec![0u64; self.peers.len()];
        tables.theirs.download(&mut fingerprints, stream)?;
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

fn warm_up_error() -> Error {
    Error::invalid_usage(
        "this is the plan's first call on this device and its stream is being captured into a CUDA graph: run the plan once outside the capture first (on any stream; the first call compiles the kernel and uploads the plan)",
    )
}

/// Where the staging, the conversion workspace and the conversion scratch sit in a call's one
/// stream-ordered allocation.
struct Arena {
    work: u64,
    scratch: u64,
    total: u64,
}

impl CudaExecutor {
    fn arena(&self) -> Arena {
        let align = |x: u64| x.div_ceil(256) * 256;
        let p = &*self.program;
        let work = align(p.staging_bytes);
        let scratch = work + align(p.work_bytes);
        Arena {
            work,
            scratch,
            total: scratch + self.scratch_bytes,
        }
    }
}

fn resolve_base(key: BaseKey, buffers: &CallBuffers<'_>, staging: u64, arena: &Arena) -> u64 {
    match (key, buffers) {
        (BaseKey::Staging, _) => staging,
        (BaseKey::Work, _) => staging + arena.work,
        (BaseKey::Scratch, _) => staging + arena.scratch,
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
    stream: sys::CUstream,
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
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })?;
            done += blocks;
        }
    }
    Ok(())
}

// Plans are shared across threads; the executor must be too.
const _: fn() = || {
    fn is<T: Send + Sync>() {}
    is::<CudaExecutor>();
};
