//! Contexts: each device's primary context (reference counted), contexts made with
//! `cuCtxCreate`, the per-thread current-context stack, and the runtime's per-thread current
//! device.
//!
//! A context owns its legacy default stream, its per-thread default streams and the streams
//! created in it; the legacy-stream synchronization rules (stream.rs) are per context.

use crate::config::config;
use crate::diag;
use crate::errors::{err, CuResult};
use crate::handles::{self, lock, Registry};
use crate::memory;
use crate::stream::{Stream, StreamKind};
use cudarc::driver::sys::CUresult;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::ThreadId;

/// One context.
pub struct Context {
    pub handle: usize,
    pub device: i32,
    pub primary: bool,
    /// Primary: retain count (active while > 0). Created: 1 until destroyed.
    refcount: Mutex<u32>,
    /// Serializes enqueues in this context, so that the legacy-stream dependencies each new
    /// piece of work takes are those of one global order (stream.rs).
    pub enqueue_lock: Mutex<()>,
    legacy: Mutex<Option<Arc<Stream>>>,
    /// Every stream of the context except the legacy one.
    streams: Mutex<Vec<Weak<Stream>>>,
    per_thread: Mutex<HashMap<ThreadId, Arc<Stream>>>,
    /// A kernel fault in NCCL_RESHARD_EMU_ON_ERROR=return mode: like CUDA's sticky errors,
    /// returned by every later synchronizing call of the context.
    pub sticky: Mutex<Option<CUresult>>,
}

static CONTEXTS: OnceLock<Registry<Context>> = OnceLock::new();

fn contexts() -> &'static Registry<Context> {
    CONTEXTS.get_or_init(Registry::default)
}

fn primaries() -> &'static Vec<Arc<Context>> {
    static PRIMARY: OnceLock<Vec<Arc<Context>>> = OnceLock::new();
    PRIMARY.get_or_init(|| {
        (0..config().devices)
            .map(|device| {
                let c = Context::new(device, true, 0);
                contexts().insert(c.handle, c.clone());
                c
            })
            .collect()
    })
}

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// `cuInit`.
pub fn init() {
    INITIALIZED.store(true, Ordering::Release);
}

/// Driver calls before `cuInit` fail with CUDA_ERROR_NOT_INITIALIZED, as on a real driver.
pub fn require_init() -> CuResult<()> {
    if INITIALIZED.load(Ordering::Acquire) {
        Ok(())
    } else {
        err(CUresult::CUDA_ERROR_NOT_INITIALIZED)
    }
}

impl Context {
    fn new(device: i32, primary: bool, refcount: u32) -> Arc<Context> {
        Arc::new(Context {
            handle: handles::next(),
            device,
            primary,
            refcount: Mutex::new(refcount),
            enqueue_lock: Mutex::new(()),
            legacy: Mutex::new(None),
            streams: Mutex::new(Vec::new()),
            per_thread: Mutex::new(HashMap::new()),
            sticky: Mutex::new(None),
        })
    }

    pub fn is_active(&self) -> bool {
        *lock(&self.refcount) > 0
    }

    /// The legacy default stream (created at first use).
    pub fn legacy_stream(self: &Arc<Self>) -> Arc<Stream> {
        lock(&self.legacy)
            .get_or_insert_with(|| Stream::new(self.clone(), StreamKind::Legacy, 0, 0))
            .clone()
    }

    /// The legacy stream if it was ever used.
    pub fn legacy_if_used(&self) -> Option<Arc<Stream>> {
        lock(&self.legacy).clone()
    }

    /// This thread's per-thread default stream (`CU_STREAM_PER_THREAD`) in this context.
    pub fn per_thread_stream(self: &Arc<Self>) -> Arc<Stream> {
        let id = std::thread::current().id();
        let mut map = lock(&self.per_thread);
        if let Some(s) = map.get(&id) {
            return s.clone();
        }
        let s = Stream::new(self.clone(), StreamKind::PerThread, 0, 0);
        self.add_stream(&s);
        map.insert(id, s.clone());
        s
    }

    pub fn add_stream(&self, stream: &Arc<Stream>) {
        let mut streams = lock(&self.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(stream));
    }

    /// Every live stream of the context, the legacy one first when used.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        let mut all: Vec<Arc<Stream>> = self.legacy_if_used().into_iter().collect();
        all.extend(lock(&self.streams).iter().filter_map(Weak::upgrade));
        all
    }

    /// Waits for all work queued so far on every stream of the context (cuCtxSynchronize).
    pub fn synchronize(&self) {
        for s in self.streams() {
            s.wait_idle();
        }
    }

    /// The sticky error, if a kernel faulted in return mode.
    pub fn sticky_error(&self) -> CuResult<()> {
        match *lock(&self.sticky) {
            Some(code) => err(code),
            None => Ok(()),
        }
    }

    /// Ends the context's life (primary released to 0, reset, or cuCtxDestroy): waits for its
    /// work, reports the allocations still live (a leak) and frees them, and retires its
    /// streams, events, modules and pools.
    fn teardown(self: &Arc<Self>, why: &str) {
        self.synchronize();
        let leaked = memory::unfreed_in_context(self.handle);
        if !leaked.is_empty() {
            let mut text = format!(
                "leak: {why} with {} allocation(s) of device {} never freed:",
                leaked.len(),
                self.device
            );
            for a in &leaked {
                text.push_str(&format!("\n    {}", a.describe()));
            }
            diag::report(text);
        }
        for a in &leaked {
            memory::release(a, why);
        }
        for s in self.streams() {
            crate::stream::retire(&s);
        }
        *lock(&self.legacy) = None;
        lock(&self.streams).clear();
        lock(&self.per_thread).clear();
        *lock(&self.sticky) = None;
        crate::event::retire_context(self.handle);
        crate::module::retire_context(self.handle);
        crate::pool::retire_context(self.handle);
    }
}

/// Looks a context handle up; inactive or destroyed contexts are CUDA_ERROR_INVALID_CONTEXT.
pub fn get(handle: usize) -> CuResult<Arc<Context>> {
    match contexts().get(handle) {
        Some(c) if c.is_active() => Ok(c),
        _ => err(CUresult::CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// A device's primary context (active or not).
pub fn primary(device: i32) -> CuResult<Arc<Context>> {
    crate::device::check(device)?;
    Ok(primaries()[device as usize].clone())
}

/// `cuDevicePrimaryCtxRetain`.
pub fn retain_primary(device: i32) -> CuResult<Arc<Context>> {
    let c = primary(device)?;
    *lock(&c.refcount) += 1;
    Ok(c)
}

/// `cuDevicePrimaryCtxRelease`: at zero the context is torn down (leak report included).
pub fn release_primary(device: i32) -> CuResult<()> {
    let c = primary(device)?;
    let last = {
        let mut n = lock(&c.refcount);
        if *n == 0 {
            return err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        *n -= 1;
        *n == 0
    };
    if last {
        c.teardown(&format!(
            "device {device}'s primary context released for the last time"
        ));
    }
    Ok(())
}

/// `cuDevicePrimaryCtxReset`: tears the primary context down whatever its count.
pub fn reset_primary(device: i32) -> CuResult<()> {
    let c = primary(device)?;
    if c.is_active() {
        c.teardown(&format!("device {device}'s primary context reset"));
    }
    *lock(&c.refcount) = 0;
    Ok(())
}

/// (retain count, active) of a primary context.
pub fn primary_state(device: i32) -> CuResult<(u32, bool)> {
    let c = primary(device)?;
    let n = *lock(&c.refcount);
    Ok((n, n > 0))
}

/// `cuCtxCreate`: a new (non-primary) context, made current.
pub fn create(device: i32) -> CuResult<Arc<Context>> {
    crate::device::check(device)?;
    let c = Context::new(device, false, 1);
    contexts().insert(c.handle, c.clone());
    push(c.handle);
    Ok(c)
}

/// `cuCtxDestroy`.
pub fn destroy(handle: usize) -> CuResult<()> {
    let c = get(handle)?;
    if c.primary {
        return err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    c.teardown(&format!("context {handle:#x} destroyed"));
    *lock(&c.refcount) = 0;
    contexts().remove(handle);
    STACK.with(|s| s.borrow_mut().retain(|&h| h != handle));
    Ok(())
}

thread_local! {
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    static RUNTIME_DEVICE: Cell<i32> = const { Cell::new(0) };
}

/// The handle on top of this thread's stack (0 when empty).
pub fn current_handle() -> usize {
    STACK.with(|s| s.borrow().last().copied().unwrap_or(0))
}

/// The current context; CUDA_ERROR_INVALID_CONTEXT when there is none or it is not active.
pub fn current() -> CuResult<Arc<Context>> {
    match current_handle() {
        0 => err(CUresult::CUDA_ERROR_INVALID_CONTEXT),
        h => get(h),
    }
}

pub fn push(handle: usize) {
    STACK.with(|s| s.borrow_mut().push(handle));
}

pub fn pop() -> Option<usize> {
    STACK.with(|s| s.borrow_mut().pop())
}

/// `cuCtxSetCurrent`: replaces the top (NULL pops).
pub fn set_current(handle: usize) {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if handle != 0 {
            s.push(handle);
        }
    });
}

/// The runtime's current device on this thread (`cudaSetDevice`, default 0).
pub fn runtime_device() -> i32 {
    RUNTIME_DEVICE.get()
}

fn runtime_retained() -> &'static Mutex<Vec<bool>> {
    static RETAINED: OnceLock<Mutex<Vec<bool>>> = OnceLock::new();
    RETAINED.get_or_init(|| Mutex::new(vec![false; config().devices.max(0) as usize]))
}

/// The runtime's hold on a device's primary context: retained once per process at first use,
/// as cudart does, and never released.
fn runtime_primary(device: i32) -> CuResult<Arc<Context>> {
    crate::device::check(device)?;
    let mut retained = lock(runtime_retained());
    if !retained[device as usize] {
        retained[device as usize] = true;
        return retain_primary(device);
    }
    let c = primary(device)?;
    if !c.is_active() {
        // Someone reset it under the runtime; the runtime re-initializes it.
        *lock(&c.refcount) += 1;
    }
    Ok(c)
}

/// `cudaSetDevice`: the thread's device, with its primary context made current.
pub fn runtime_set_device(device: i32) -> CuResult<()> {
    let c = runtime_primary(device)?;
    RUNTIME_DEVICE.set(device);
    set_current(c.handle);
    Ok(())
}

/// The context a runtime call uses: the current driver context when there is one, else the
/// primary context of the runtime's device, made current.
pub fn runtime_context() -> CuResult<Arc<Context>> {
    crate::context::init();
    if let Ok(c) = current() {
        return Ok(c);
    }
    let c = runtime_primary(runtime_device())?;
    set_current(c.handle);
    Ok(c)
}
