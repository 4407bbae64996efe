//! One call of a rank's program on a device: the local steps of the walk (`exec::schedule`)
//! as kernel launches on the caller's stream, side work on a side stream (a round's
//! conversions beside the round before, the local copies beside the first round, late unpacks
//! beside the next round), staging from the device's stream-ordered pool for the call; the
//! round exchanges come from the transport ([`Exchange`]).

use super::descriptors::{Addressing, BaseKey, MAX_BASES};
use super::device::{Device, SideStream};
use super::driver::{self, Event, Kernel};
use super::tables::{Arena, DeviceProgram, Phases, Tables, Uploaded};
use crate::error::{Error, Result};
use crate::exec::buffers::CallBuffers;
use crate::exec::schedule::{Step, Steps};
use crate::plan::{Loc, Round};
use cudarc::driver::sys;
use std::ffi::c_void;

/// Threads per block; must match `NCCL_RESHARD_THREADS` in kernels/copy.cu.
const THREADS: u32 = 256;
/// Blocks per SM of a launch on the caller's stream. The kernels are persistent grids (their
/// blocks walk the tiles grid-stride), so this is all a launch ever puts on the GPU: two
/// blocks of 256 threads with 64 bytes in flight each is 32 KiB per SM, 4.3 MB on an H200's
/// 132 SMs, about twice what HBM needs outstanding to stream at full speed (docs/executor.md,
/// "The kernel"); the kernels' launch bound makes two fit an SM's registers.
const BLOCKS_PER_SM: u64 = 2;

/// How large a launch's grid may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grid {
    /// On the caller's stream with nothing of ours beside it: [`BLOCKS_PER_SM`] per SM.
    Full,
    /// On the caller's stream while this call's late unpacks may still run on its side
    /// stream: one block per SM, so that every SM keeps registers for a side-stream block
    /// (blocks of a persistent grid that cannot be resident would start only when others end).
    BesideLate,
    /// Late unpacks on the side stream, beside the next round's NCCL kernel: half the SMs at
    /// one block each. An NCCL block (up to 640 threads at up to 96 registers) needs nearly a
    /// whole SM's register file, so leaving room for NCCL means leaving SMs free, not a few
    /// registers on each; the late unpacks still stream about 1 TB/s (docs/executor.md).
    Side,
}

impl Grid {
    /// The most blocks a launch of this kind gets on a device with `sms` SMs.
    fn blocks(self, sms: u32) -> u64 {
        let sms = u64::from(sms.max(1));
        match self {
            Grid::Full => BLOCKS_PER_SM * sms,
            Grid::BesideLate => sms,
            Grid::Side => sms.div_ceil(2),
        }
    }
}

/// What a device transport implements: one round's sends and receives, posted as one group in
/// stream order on the call's stream, at the device addresses `memory` gives.
pub(crate) trait Exchange {
    fn exchange(&mut self, k: usize, round: &Round<'_>, memory: &CallMemory<'_>) -> Result<()>;
}

/// Where a call's buffers are on the device: the caller's views and the call's staging.
pub(crate) struct CallMemory<'a> {
    pub addressing: Addressing<'a>,
    buffers: &'a CallBuffers<'a>,
    staging: u64,
    arena: Arena,
}

impl CallMemory<'_> {
    /// The pointer a base slot holds in this call.
    pub fn base(&self, key: BaseKey) -> u64 {
        let (staging, arena) = (self.staging, &self.arena);
        match (key, self.buffers) {
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

    /// The device address of a program location in this call.
    pub fn address(&self, loc: Loc) -> u64 {
        let (key, offset) = self.addressing.resolve(loc);
        self.base(key) + offset
    }
}

/// A call in progress on one device: its staging, its side stream, and the transport's
/// exchange. Made by [`DeviceCall::begin`], ended by [`DeviceCall::finish`].
pub(crate) struct DeviceCall<'a, E> {
    device: &'a Device,
    kernel: &'a Kernel,
    phases: &'a Phases,
    stream: sys::CUstream,
    memory: CallMemory<'a>,
    /// For side work: conversions beside the round before theirs, local copies beside the
    /// first round, late unpacks (none under capture: they then stay on the caller's stream).
    side: Option<SideStream>,
    /// The call is being captured into a graph (its staging is graph memory).
    capturing: bool,
    /// Per arena parity: the side stream has late unpacks reading it that the caller's stream
    /// has not yet waited for.
    pending: [bool; 2],
    /// The side stream has a round's conversions the caller's stream has not yet waited for.
    converting: bool,
    /// The side stream has the local copies the caller's stream has not yet waited for.
    copying: bool,
    /// The transport's exchange.
    pub exchange: E,
}

impl<'a, E: Exchange> DeviceCall<'a, E> {
    /// Takes what the call needs before anything is enqueued: its staging (allocated on
    /// `stream`) and, when it has side work (`RankProgram::has_side_work`) and `stream` is
    /// not being captured, a side stream. Fails with nothing taken.
    ///
    /// Under capture that side work stays on the caller's stream, in order: a stream that joined
    /// a capture belongs to it until the capture ends, so it could not serve another call
    /// meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        device: &'a Device,
        program: &'a DeviceProgram,
        tables: &'a Tables,
        buffers: &'a CallBuffers<'a>,
        stream: sys::CUstream,
        capturing: bool,
        exchange: E,
    ) -> Result<Self> {
        let kernel = device.kernel()?;
        let (phases, addressing) = match buffers {
            CallBuffers::Single { .. } => (&tables.single, program.single_addressing()),
            CallBuffers::PerTensor { .. } => (&tables.per_tensor, Addressing::PerTensor),
        };
        let arena = program.arena();
        let staging = match arena.total {
            0 => 0,
            bytes => {
                let bytes = usize::try_from(bytes)
                    .map_err(|_| Error::invalid_usage("staging does not fit the address space"))?;
                device.pool()?.alloc(bytes, stream)?
            }
        };
        let side = if program.program.has_side_work() && !capturing {
            match device.side_stream() {
                Ok(side) => Some(side),
                Err(e) => {
                    if staging != 0 {
                        let _ = device.pool().and_then(|pool| pool.free(staging, stream));
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        Ok(DeviceCall {
            device,
            kernel,
            phases,
            stream,
            memory: CallMemory {
                addressing,
                buffers,
                staging,
                arena,
            },
            side,
            capturing,
            pending: [false; 2],
            converting: false,
            copying: false,
            exchange,
        })
    }

    /// Gives the side stream back (the caller's stream already waits for its work) and frees
    /// the staging in stream order; a captured call also has its graph memory trimmed after
    /// each launch (`release.rs`) unless staging is kept.
    pub fn finish(self) -> Result<()> {
        if let Some(side) = self.side {
            self.device.give_back(side);
        }
        match self.memory.staging {
            0 => Ok(()),
            staging => {
                self.device.pool()?.free(staging, self.stream)?;
                if self.capturing && !super::release::keep_staging() {
                    super::release::after_captured_call(self.stream, self.device.context.ordinal)?;
                }
                Ok(())
            }
        }
    }

    /// Launches `tables` on the caller's stream.
    fn launch(&self, tables: &Uploaded) -> Result<()> {
        let grid = if self.converting || self.copying || self.pending.iter().any(|&p| p) {
            Grid::BesideLate
        } else {
            Grid::Full
        };
        let blocks = grid.blocks(self.device.multiprocessors);
        launch_all(self.kernel, tables, &self.memory, self.stream, blocks)
    }
}

impl<E: Exchange> Steps for DeviceCall<'_, E> {
    fn run(&mut self, step: Step) -> Result<()> {
        let phases = self.phases;
        let passes = match step {
            Step::FirstConverts => phases.rounds[0].converts.as_slice(),
            Step::LocalCopies => std::slice::from_ref(&phases.local),
            Step::Packs(k) => std::slice::from_ref(&phases.rounds[k].before),
            Step::EarlyUnpacks(k) => std::slice::from_ref(&phases.rounds[k].early),
            Step::ConvertsAfter => phases.converts_after.as_slice(),
        };
        passes.iter().try_for_each(|pass| self.launch(pass))
    }

    fn exchange(&mut self, k: usize, round: &Round<'_>) -> Result<()> {
        self.exchange.exchange(k, round, &self.memory)
    }

    /// The senders' barrier: one more group of the transport's, on the caller's stream.
    fn barrier(&mut self, round: &Round<'_>) -> Result<()> {
        self.exchange.exchange(0, round, &self.memory)
    }

    /// Round `k`'s conversions beside the round before (from before its packs).
    fn fork_converts(&mut self, k: usize) -> Result<()> {
        let (wait, result) = self.beside(&self.phases.rounds[k].converts, |s| &s.converted);
        self.converting = wait;
        result
    }

    fn join_converts(&mut self, _: usize) -> Result<()> {
        let wait = std::mem::take(&mut self.converting);
        self.wait_for(wait, |s| &s.converted)
    }

    /// The local copies beside the first round (from after its conversions).
    fn fork_local(&mut self) -> Result<()> {
        let (wait, result) = self.beside(std::slice::from_ref(&self.phases.local), |s| &s.copied);
        self.copying = wait;
        result
    }

    fn join_local(&mut self) -> Result<()> {
        let wait = std::mem::take(&mut self.copying);
        self.wait_for(wait, |s| &s.copied)
    }

    /// Round `k`'s late unpacks beside the next round (from after its exchange).
    fn fork_late(&mut self, k: usize) -> Result<()> {
        let late = std::slice::from_ref(&self.phases.rounds[k].late);
        let (wait, result) = self.beside(late, |s| &s.done[k % 2]);
        self.pending[k % 2] |= wait;
        result
    }

    fn join_late(&mut self, parity: usize) -> Result<()> {
        let wait = std::mem::take(&mut self.pending[parity]);
        self.wait_for(wait, |s| &s.done[parity])
    }
}

impl<E: Exchange> DeviceCall<'_, E> {
    /// Runs `passes` beside the caller's stream: on the side stream once the caller's stream
    /// has passed this point, on half the SMs, `done(side)` recorded after them (then `true`:
    /// the caller's stream must wait for it before what they feed); without a side stream,
    /// here on the caller's stream (`false`). The launches' result comes second: a failed
    /// launch still marks `done`, so that nothing waits for work that never started.
    fn beside(
        &self,
        passes: &[Uploaded],
        done: impl Fn(&SideStream) -> &Event,
    ) -> (bool, Result<()>) {
        let Some(side) = &self.side else {
            return (false, passes.iter().try_for_each(|pass| self.launch(pass)));
        };
        let forked = side
            .fork
            .record(self.stream)
            .and_then(|()| side.fork.wait_on(side.stream.0));
        if let Err(e) = forked {
            return (false, Err(e));
        }
        let blocks = Grid::Side.blocks(self.device.multiprocessors);
        let launched = passes.iter().try_for_each(|pass| {
            launch_all(self.kernel, pass, &self.memory, side.stream.0, blocks)
        });
        match done(side).record(side.stream.0) {
            Ok(()) => (true, launched),
            Err(e) => (false, Err(e)),
        }
    }

    /// Makes the caller's stream wait for `done(side)` when `wait`.
    fn wait_for(&self, wait: bool, done: impl Fn(&SideStream) -> &Event) -> Result<()> {
        match &self.side {
            Some(side) if wait => done(side).wait_on(self.stream),
            _ => Ok(()),
        }
    }
}

#[repr(C)]
struct Bases([u64; MAX_BASES]);

/// Launches every launch of `tables` on `stream`, each with at most `max_blocks` blocks.
fn launch_all(
    kernel: &Kernel,
    tables: &Uploaded,
    memory: &CallMemory<'_>,
    stream: sys::CUstream,
    max_blocks: u64,
) -> Result<()> {
    let function = if tables.convert {
        kernel.convert
    } else {
        kernel.function
    };
    for launch in &tables.launches {
        let mut bases = Bases([0; MAX_BASES]);
        for (slot, &key) in launch.bases.iter().enumerate() {
            bases.0[slot] = memory.base(key);
        }
        let blocks = launch.tiles.min(max_blocks).max(1);
        let mut descs = tables.descs.ptr;
        let mut tiles = tables.tiles.ptr;
        let mut first = launch.first_tile;
        let mut count = launch.tiles;
        let mut params: [*mut c_void; 5] = [
            (&mut descs as *mut u64).cast(),
            (&mut tiles as *mut u64).cast(),
            (&mut first as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
            (&mut bases as *mut Bases).cast(),
        ];
        // SAFETY: both kernels' parameters are (const CopyDesc*, const Tile*, u64, u64,
        // Bases), matching `params`; the tables stay alive while the plan does; `blocks` is at
        // most a few per SM, far below the grid limit.
        driver::call("cuLaunchKernel", || unsafe {
            sys::cuLaunchKernel(
                function,
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
    }
    Ok(())
}
