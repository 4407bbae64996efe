//! A rank's program on one device: its kernel tables for both ways of passing buffers, uploaded
//! at the program's first call there (warm-up), and where the call's staging, conversion
//! workspace and conversion scratch sit in its one stream-ordered allocation. What any device
//! transport needs to run the local steps of a program; the transport adds its exchange.

use super::descriptors::{
    convert_tables, encode, encode_converts, Addressing, ConvertPasses, Encoded, Launch,
    MAX_CONVERT_TILES,
};
use super::device::{self, Device};
use super::driver::{DeviceBuffer, Event, PrivateStream, RelaxedCapture};
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::exec::Limits;
use crate::plan::RankProgram;
use cudarc::driver::sys;
use std::sync::{Arc, Mutex, OnceLock};

/// Descriptor tables of one set of copies or one conversion pass, on the device.
pub(crate) struct Uploaded {
    pub launches: Vec<Launch>,
    pub descs: DeviceBuffer,
    pub tiles: DeviceBuffer,
    /// A conversion pass (the conversion kernel runs it; copies run on the copy kernel).
    pub convert: bool,
}

/// One round's tables: its conversions (their passes), its packs, the unpacks that finish
/// before the next round, and the late ones.
pub(crate) struct RoundTables {
    pub converts: Vec<Uploaded>,
    pub before: Uploaded,
    pub early: Uploaded,
    pub late: Uploaded,
}

/// The tables of one addressing (single-buffer or per-tensor call): the local copies, per
/// round its tables, and the conversions after the rounds.
pub(crate) struct Phases {
    pub local: Uploaded,
    pub rounds: Vec<RoundTables>,
    pub converts_after: Vec<Uploaded>,
}

/// What warm-up puts on the device for one program: its tables for both ways of passing
/// buffers (so a later call of either kind needs no upload, also during a capture), and the
/// constant buffers the transport asked for.
pub(crate) struct Tables {
    pub single: Phases,
    pub per_tensor: Phases,
    /// [`DeviceProgram::new`]'s `constants`, in that order.
    pub constants: Vec<DeviceBuffer>,
}

/// A program's state on its device. Dropped with the plan, with the context current.
pub(crate) struct PlanDevice {
    pub device: Arc<Device>,
    tables: OnceLock<Tables>,
    init: Mutex<()>,
    /// The end of each call that may still be running (marked on its stream): the tables are
    /// freed in stream order after all of them, never before (a plan destroyed right after a
    /// failed call may still have operations draining).
    uses: Mutex<Vec<Event>>,
}

impl PlanDevice {
    /// Marks the end of a call on `stream` (not under capture: a graph's launches are the
    /// caller's to finish before destroying the plan), dropping marks already passed.
    pub fn mark_use(&self, stream: sys::CUstream) -> Result<()> {
        let event = self.device.event()?;
        event.record(stream)?;
        let mut uses = self
            .uses
            .lock()
            .map_err(|_| Error::internal("plan lock poisoned"))?;
        let (done, pending): (Vec<Event>, Vec<Event>) = std::mem::take(&mut *uses)
            .into_iter()
            .partition(|e| e.is_done().unwrap_or(false));
        *uses = pending;
        uses.push(event);
        self.device.give_back_events(done);
        Ok(())
    }
}

impl Drop for PlanDevice {
    fn drop(&mut self) {
        let _current = self.device.context.push();
        // The tables' frees (DeviceBuffer) run on the release stream once every call using them
        // has ended; without a release stream, nothing is freed (rather than too early).
        let uses = self.uses.get_mut().map(std::mem::take).unwrap_or_default();
        match self.device.release_stream() {
            Ok(release) => {
                for event in &uses {
                    let _ = event.wait_on(release.0);
                }
                drop(self.tables.take());
            }
            Err(_) => std::mem::forget(self.tables.take()),
        }
        self.device.give_back_events(uses);
        if let Some(pool) = self.device.existing_pool() {
            pool.trim();
        }
    }
}

/// Where the staging, the conversion workspace and the conversion scratch sit in a call's one
/// stream-ordered allocation (byte offsets; `total` bytes in all).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arena {
    pub work: u64,
    pub scratch: u64,
    pub total: u64,
}

/// One rank's program as a device transport runs it: created with the plan (no CUDA calls);
/// the first call on a device uploads it there.
pub(crate) struct DeviceProgram {
    pub program: Arc<RankProgram>,
    src_offsets: Vec<u64>,
    dst_offsets: Vec<u64>,
    /// 8-byte words the transport keeps on the device for the plan's life (uploaded with the
    /// tables: a capture may not upload).
    constants: Vec<Vec<u64>>,
    arena: Arena,
    state: Mutex<Option<Arc<PlanDevice>>>,
}

/// The GPU runtime's limits: what the kernel's tables can hold, checked at plan creation
/// (`exec::Plan`), where every rank refuses alike, not at the first call.
pub struct DeviceLimits;

impl Limits for DeviceLimits {
    fn check(&self, program: &RankProgram) -> Result<()> {
        // The kernel's conversion tables grow with a box's items (16-byte strips of its rows,
        // a few to 64 per item).
        let rounds = program
            .rounds_iter()
            .map(|round| ("before", round.converts));
        for (when, converts) in rounds.chain([("after", &program.converts_after[..])]) {
            let (_, tiles) = convert_tables(converts);
            if tiles > MAX_CONVERT_TILES {
                return Err(Error::invalid_usage(format!(
                    "rank {}'s conversions {when} the rounds need {tiles} kernel tiles, more than {MAX_CONVERT_TILES}: its boxes have too many elements or too narrow blocks for their size; use wider quantization blocks (quant.blockCols) or fewer elements per rank",
                    program.rank
                )));
            }
        }
        Ok(())
    }
}

impl DeviceProgram {
    /// `src_offsets`/`dst_offsets`: byte offsets of each tensor's views in the single-buffer
    /// call; `constants`: words to keep on the device (see [`Tables::constants`]).
    pub fn new(
        program: Arc<RankProgram>,
        src_offsets: Vec<u64>,
        dst_offsets: Vec<u64>,
        constants: Vec<Vec<u64>>,
    ) -> Self {
        let align = |x: u64| x.div_ceil(256) * 256;
        // One set of conversions runs at a time (a round's, on either stream, or those after
        // the rounds), so they share one scratch.
        let scratch_bytes = program
            .rounds_iter()
            .map(|round| round.converts)
            .chain([&program.converts_after[..]])
            .map(|c| convert_tables(c).0)
            .max()
            .unwrap_or(0);
        let work = align(program.staging_bytes);
        let scratch = work + align(program.work_bytes);
        let arena = Arena {
            work,
            scratch,
            total: scratch + scratch_bytes,
        };
        DeviceProgram {
            program,
            src_offsets,
            dst_offsets,
            constants,
            arena,
            state: Mutex::new(None),
        }
    }

    /// `program` (another of the plan's programs) with the same views' offsets.
    pub fn sibling(&self, program: Arc<RankProgram>, constants: Vec<Vec<u64>>) -> DeviceProgram {
        DeviceProgram::new(
            program,
            self.src_offsets.clone(),
            self.dst_offsets.clone(),
            constants,
        )
    }

    /// How the single-buffer call addresses the tensors' views.
    pub fn single_addressing(&self) -> Addressing<'_> {
        Addressing::Single {
            src_offsets: &self.src_offsets,
            dst_offsets: &self.dst_offsets,
        }
    }

    pub fn arena(&self) -> Arena {
        self.arena
    }

    /// The program's state on `ordinal` (one device per plan).
    pub fn on_device(&self, ordinal: i32) -> Result<Arc<PlanDevice>> {
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
            uses: Mutex::new(Vec::new()),
        });
        *slot = Some(state.clone());
        Ok(state)
    }

    /// The program's tables on the device of `state` (its context current), uploaded by this
    /// call if it is the first (warm-up). A first call during a graph capture (`capturing`)
    /// is refused: compiling, loading and uploading are not capturable.
    pub fn tables<'s>(&self, state: &'s PlanDevice, capturing: bool) -> Result<&'s Tables> {
        match state.tables.get() {
            Some(tables) => Ok(tables),
            None if capturing => Err(Error::invalid_usage(
                "this is the plan's first call on this device and its stream is being captured into a CUDA graph: run the plan once outside the capture first (on any stream; the first call compiles the kernel and uploads the plan)",
            )),
            None => self.warm_up(state),
        }
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
        let started = std::time::Instant::now();
        state.device.kernel()?;
        let kernel_ready = started.elapsed();
        let pool = state.device.pool()?;
        let release = state.device.release_stream()?;
        let upload = PrivateStream::new()?;
        let upload_one = |e: &Encoded, convert: bool| -> Result<Uploaded> {
            Ok(Uploaded {
                descs: DeviceBuffer::upload(&e.descs, "copy descriptors", pool, &upload, release)?,
                tiles: DeviceBuffer::upload(&e.tiles, "copy tiles", pool, &upload, release)?,
                launches: e.launches.clone(),
                convert,
            })
        };
        let one = |e: &Encoded| upload_one(e, false);
        let passes = |c: ConvertPasses| -> Result<Vec<Uploaded>> {
            c.passes
                .iter()
                .filter(|e| !e.is_empty())
                .map(|e| upload_one(e, true))
                .collect()
        };
        let phases = |addressing: Addressing<'_>| -> Result<Phases> {
            let rounds = p
                .rounds_iter()
                .map(|round| {
                    Ok(RoundTables {
                        converts: passes(encode_converts(round.converts, addressing))?,
                        before: one(&encode(round.packs, addressing))?,
                        early: one(&encode(round.early_unpacks(), addressing))?,
                        late: one(&encode(round.late_unpacks(), addressing))?,
                    })
                })
                .collect::<Result<_>>()?;
            Ok(Phases {
                local: one(&encode(&p.local_copies, addressing))?,
                rounds,
                converts_after: passes(encode_converts(&p.converts_after, addressing))?,
            })
        };
        let tables = Tables {
            single: phases(self.single_addressing())?,
            per_tensor: phases(Addressing::PerTensor)?,
            constants: self
                .constants
                .iter()
                .map(|words| DeviceBuffer::upload(words, "plan constants", pool, &upload, release))
                .collect::<Result<_>>()?,
        };
        // The host vectors above stay alive until the copies have landed.
        upload.synchronize()?;
        // First-call costs, said rather than left as surprises (docs/executor.md, "The first
        // call"): the kernel (compiled once per process and device), this upload, and NCCL's
        // connections, which NCCL makes during the first exchange with each peer.
        debug::log(Level::Info, || {
            format!(
                "rank {}: first call on device {}: copy kernel ready after {:.1} ms, tables uploaded in {:.1} ms; NCCL connects to the plan's {} peer(s) during this call",
                p.rank,
                state.device.context.ordinal,
                kernel_ready.as_secs_f64() * 1e3,
                (started.elapsed() - kernel_ready).as_secs_f64() * 1e3,
                p.peers().len()
            )
        });
        Ok(state.tables.get_or_init(|| tables))
    }
}
