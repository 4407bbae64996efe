//! What the executor keeps per GPU for the life of the process, shared by every plan: the
//! device's primary context (the one the CUDA runtime, NCCL and PyTorch use), the copy kernel
//! loaded into it, and the stream-ordered pool staging comes from. Plans come and go; these
//! stay, as NCCL's per-device resources do.

use super::driver::{self, Event, Kernel, MemoryPool, PrimaryContext, PrivateStream};
use super::nvrtc::{self, ImageKind};
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) struct Device {
    pub context: PrimaryContext,
    /// Its streaming multiprocessors: launches cap their grids at a few blocks per SM.
    pub multiprocessors: u32,
    kernel: OnceLock<Kernel>,
    pool: OnceLock<MemoryPool>,
    /// Where plans' device memory is freed (`DeviceBuffer`).
    release: OnceLock<PrivateStream>,
    /// Side streams not in use by a call (see [`SideStream`]).
    sides: Mutex<Vec<SideStream>>,
    /// Events not in use (a call with a deadline marks its stages with them).
    events: Mutex<Vec<Event>>,
    init: Mutex<()>,
}

/// Side streams a device keeps for reuse (more exist only while that many calls overlap).
const SIDE_STREAMS_KEPT: usize = 8;

/// A non-blocking stream of the device's primary context, at its least priority (side work
/// yields to the rounds' NCCL kernels), with five events, which one call at a time uses to run
/// its late unpacks beside its next round, a round's conversions beside the round before and
/// its local copies beside its first round (docs/executor.md, "Overlapping unpacks",
/// "Conversions beside transfers", "Local copies beside the first round"): `fork` marks on the
/// caller's stream where side work may start (the end of a round's NCCL group, or the start of
/// a round's packs), `done[parity]` the end of the late unpacks of the last round of that
/// parity, `converted` the end of the next round's conversions, `copied` the end of the local
/// copies.
pub(crate) struct SideStream {
    pub stream: PrivateStream,
    pub fork: Event,
    pub done: [Event; 2],
    pub converted: Event,
    pub copied: Event,
}

/// The process's state for device `ordinal` (its primary context retained on first use).
pub(crate) fn device(ordinal: i32) -> Result<Arc<Device>> {
    static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<Device>>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| Error::internal("device table poisoned"))?;
    if let Some(device) = devices.get(&ordinal) {
        return Ok(device.clone());
    }
    let context = PrimaryContext::retain(ordinal)?;
    let device = Arc::new(Device {
        multiprocessors: context.multiprocessors()?,
        context,
        kernel: OnceLock::new(),
        pool: OnceLock::new(),
        release: OnceLock::new(),
        sides: Mutex::new(Vec::new()),
        events: Mutex::new(Vec::new()),
        init: Mutex::new(()),
    });
    devices.insert(ordinal, device.clone());
    Ok(device)
}

impl Device {
    /// The copy kernel, compiled and loaded on first use. Needs the context current and,
    /// the first time, a moment where loading a module is allowed (no capture on this thread's
    /// stream; the caller relaxes the thread's capture mode).
    pub fn kernel(&self) -> Result<&Kernel> {
        if let Some(kernel) = self.kernel.get() {
            return Ok(kernel);
        }
        let _init = self
            .init
            .lock()
            .map_err(|_| Error::internal("device lock poisoned"))?;
        if let Some(kernel) = self.kernel.get() {
            return Ok(kernel);
        }
        let started = std::time::Instant::now();
        let (major, minor) = self.context.compute_capability()?;
        let driver = driver::driver_version()?;
        let image = nvrtc::image(major, minor, driver)?;
        let kernel = Kernel::load(&image.image, nvrtc::KERNEL_NAME, nvrtc::CONVERT_KERNEL_NAME)
            .map_err(|e| Error {
                message: format!(
                    "{} (kernel compiled by {} as {} for {}_{})",
                    e.message,
                    image.compiler,
                    match image.kind {
                        ImageKind::Cubin => "a cubin",
                        ImageKind::Ptx => "PTX",
                    },
                    match image.kind {
                        ImageKind::Cubin => "sm",
                        ImageKind::Ptx => "compute",
                    },
                    image.arch
                ),
                ..e
            })?;
        debug::log(Level::Info, || {
            format!(
                "device {}: copy and conversion kernels compiled and loaded in {:.1} ms ({:?} for arch {} by {}, driver CUDA {}.{})",
                self.context.ordinal,
                started.elapsed().as_secs_f64() * 1e3,
                image.kind,
                image.arch,
                image.compiler,
                driver / 1000,
                driver % 1000 / 10
            )
        });
        Ok(self.kernel.get_or_init(|| kernel))
    }

    /// The staging pool, created on first use (context current).
    pub fn pool(&self) -> Result<&MemoryPool> {
        if let Some(pool) = self.pool.get() {
            return Ok(pool);
        }
        let _init = self
            .init
            .lock()
            .map_err(|_| Error::internal("device lock poisoned"))?;
        if let Some(pool) = self.pool.get() {
            return Ok(pool);
        }
        let pool = MemoryPool::new(
            self.context.device,
            self.context.ordinal,
            super::release::keep_staging(),
        )?;
        Ok(self.pool.get_or_init(|| pool))
    }

    /// The stream plans' device memory is freed on (context current), created on first use.
    pub fn release_stream(&self) -> Result<&PrivateStream> {
        if let Some(stream) = self.release.get() {
            return Ok(stream);
        }
        let _init = self
            .init
            .lock()
            .map_err(|_| Error::internal("device lock poisoned"))?;
        if let Some(stream) = self.release.get() {
            return Ok(stream);
        }
        let stream = PrivateStream::new()?;
        Ok(self.release.get_or_init(|| stream))
    }

    /// A side stream for one call (context current): one whose work has all completed, or a
    /// new one. Never one with another call's work still pending: the new call's stream would
    /// then wait for that call's NCCL operations, a dependency between communicators that can
    /// deadlock (two threads with their own communicators, each waiting on the other's peers).
    /// Give it back with [`Device::give_back`] once the call has made the caller's stream
    /// wait for it.
    pub fn side_stream(&self) -> Result<SideStream> {
        let idle = {
            let mut sides = self
                .sides
                .lock()
                .map_err(|_| Error::internal("device lock poisoned"))?;
            sides
                .iter()
                .position(|side| side.stream.is_idle())
                .map(|i| sides.swap_remove(i))
        };
        match idle {
            Some(side) => Ok(side),
            None => Ok(SideStream {
                stream: PrivateStream::lowest_priority()?,
                fork: Event::new()?,
                done: [Event::new()?, Event::new()?],
                converted: Event::new()?,
                copied: Event::new()?,
            }),
        }
    }

    /// Returns a side stream for later calls, which take it once its work has completed. Past
    /// [`SIDE_STREAMS_KEPT`] kept ones it is destroyed (its pending work still completes).
    pub fn give_back(&self, side: SideStream) {
        if let Ok(mut sides) = self.sides.lock() {
            if sides.len() < SIDE_STREAMS_KEPT {
                sides.push(side);
            }
        }
    }

    /// An event of this device (context current), reused once given back: one whose last
    /// recorded point has passed.
    pub fn event(&self) -> Result<Event> {
        let reused = self.events.lock().ok().and_then(|mut events| events.pop());
        match reused {
            Some(event) => Ok(event),
            None => Event::new(),
        }
    }

    /// Keeps events for later calls (at most a few hundred; the rest are destroyed).
    pub fn give_back_events(&self, done: impl IntoIterator<Item = Event>) {
        if let Ok(mut events) = self.events.lock() {
            for event in done {
                if events.len() < 256 {
                    events.push(event);
                }
            }
        }
    }

    /// The pool if it exists (for trimming when a plan goes).
    pub fn existing_pool(&self) -> Option<&MemoryPool> {
        self.pool.get()
    }
}
