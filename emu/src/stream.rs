//! Streams: in-order queues of work, each executed by its own worker thread, with CUDA's legacy
//! default stream rules.
//!
//! Enqueueing returns at once; the worker runs each piece of work after the ones before it on
//! the stream and after its extra dependencies (events waited on, legacy-stream order). Per
//! context: work on the legacy stream waits for all work queued before it on the context's
//! blocking streams, and work on a blocking stream waits for work queued before it on the legacy
//! stream; streams created with `CU_STREAM_NON_BLOCKING` take part in neither rule
//! (`CU_STREAM_PER_THREAD` streams are blocking). While a stream is captured into a graph its
//! work is recorded instead (capture.rs).

use crate::capture::{self, Capture};
use crate::completion::Completion;
use crate::context::{self, Context};
use crate::errors::{err, CuResult};
use crate::handles::{self, lock, Registry};
use crate::memory::Allocation;
use crate::{graph, kernel, memop, nccl, pool, transfer};
use cudarc::driver::sys::CUresult;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// `CU_STREAM_NON_BLOCKING`.
pub const NON_BLOCKING: u32 = 1;
/// `CU_STREAM_LEGACY`.
pub const LEGACY_HANDLE: usize = 1;
/// `CU_STREAM_PER_THREAD`.
pub const PER_THREAD_HANDLE: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// The context's legacy default stream (handle 0 or `CU_STREAM_LEGACY`).
    Legacy,
    /// A thread's `CU_STREAM_PER_THREAD` stream in a context (blocking).
    PerThread,
    /// `cuStreamCreate`.
    Created,
}

/// One piece of stream work. Work recorded into a graph is replayed by reference, so `run`
/// takes `&self` and may run many times.
#[derive(Clone)]
pub enum Work {
    /// Only orders (event waits, event records, joins).
    Nop,
    Kernel(Arc<kernel::Launch>),
    Copy(Arc<transfer::Copy>),
    Memset(Arc<transfer::Memset>),
    /// A synchronous pageable HtoD copy's deferred device write (legacy stream).
    PageableWrite(Arc<transfer::PageableWrite>),
    HostFunc {
        func: unsafe extern "C" fn(*mut c_void),
        data: usize,
    },
    /// An NCCL group's operations on this stream ("the NCCL kernel").
    Nccl(Arc<nccl::ops::StreamOp>),
    /// An NCCL group captured into a graph: issued anew at each launch.
    NcclCaptured(Arc<nccl::ops::Template>),
    /// A stream-ordered allocation becomes usable.
    AllocReached(Arc<Allocation>),
    /// A stream-ordered free takes effect.
    FreeReached(Arc<pool::Freed>),
    /// A graph launch: the graph's work in order.
    Graph(Arc<graph::Replay>),
    /// `cuStreamWaitValue32_v2`: blocks the stream until a word in memory meets a condition.
    WaitValue(Arc<memop::WaitValue>),
    /// `cuStreamWriteValue32_v2`.
    WriteValue(Arc<memop::WriteValue>),
}

/// What the work in flight belongs to, for reports.
pub struct Exec<'a> {
    pub stream: &'a Stream,
}

impl Exec<'_> {
    pub fn device(&self) -> i32 {
        self.stream.context.device
    }
}

impl Work {
    pub fn run(&self, exec: &Exec<'_>) {
        match self {
            Work::Nop => {}
            Work::Kernel(launch) => kernel::run(launch, exec),
            Work::Copy(c) => c.run(exec),
            Work::Memset(m) => m.run(exec),
            Work::PageableWrite(w) => w.run(),
            Work::HostFunc { func, data } => {
                // SAFETY: the caller of cuLaunchHostFunc passed this function and its argument.
                unsafe { func(*data as *mut c_void) }
            }
            Work::Nccl(op) => op.run(exec),
            Work::NcclCaptured(_) => {
                crate::diag::fatal("emulator bug: a captured NCCL group ran without being issued")
            }
            Work::AllocReached(a) => pool::reached_alloc(a),
            Work::FreeReached(f) => f.run(),
            Work::Graph(r) => r.run(exec),
            Work::WaitValue(w) => w.run(exec),
            Work::WriteValue(w) => w.run(exec),
        }
    }
}

struct Queued {
    work: Work,
    deps: Vec<Arc<Completion>>,
    done: Arc<Completion>,
}

struct Inner {
    queue: VecDeque<Queued>,
    /// The completion of the last work queued (done when the stream is idle).
    tail: Arc<Completion>,
    worker: bool,
    retired: bool,
    capture: Option<Arc<Capture>>,
}

/// One stream.
pub struct Stream {
    /// The handle callers use (for the legacy and per-thread streams: an internal one, for
    /// reports only).
    pub handle: usize,
    pub context: Arc<Context>,
    pub kind: StreamKind,
    pub flags: u32,
    pub priority: i32,
    inner: Mutex<Inner>,
    cv: Condvar,
}

fn registry() -> &'static Registry<Stream> {
    static STREAMS: OnceLock<Registry<Stream>> = OnceLock::new();
    STREAMS.get_or_init(Registry::default)
}

impl Stream {
    pub fn new(context: Arc<Context>, kind: StreamKind, flags: u32, priority: i32) -> Arc<Stream> {
        Arc::new(Stream {
            handle: handles::next(),
            context,
            kind,
            flags,
            priority,
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                tail: Arc::new(Completion::done()),
                worker: false,
                retired: false,
                capture: None,
            }),
            cv: Condvar::new(),
        })
    }

    /// Blocking streams synchronize with the legacy stream.
    pub fn is_blocking(&self) -> bool {
        self.kind != StreamKind::Created || self.flags & NON_BLOCKING == 0
    }

    /// How reports name the stream.
    pub fn name(&self) -> String {
        match self.kind {
            StreamKind::Legacy => format!(
                "the legacy default stream of device {} (context {:#x})",
                self.context.device, self.context.handle
            ),
            StreamKind::PerThread => format!(
                "a per-thread default stream of device {}",
                self.context.device
            ),
            StreamKind::Created => format!(
                "stream {:#x} (device {}{})",
                self.handle,
                self.context.device,
                if self.is_blocking() {
                    ""
                } else {
                    ", non-blocking"
                }
            ),
        }
    }

    /// The completion of the last work queued so far.
    pub fn tail(&self) -> Arc<Completion> {
        lock(&self.inner).tail.clone()
    }

    /// Waits until all work queued so far has run.
    pub fn wait_idle(&self) {
        self.tail().wait();
    }

    pub fn is_idle(&self) -> bool {
        self.tail().is_done()
    }

    pub fn capture(&self) -> Option<Arc<Capture>> {
        lock(&self.inner).capture.clone()
    }

    pub fn set_capture(&self, capture: Option<Arc<Capture>>) {
        lock(&self.inner).capture = capture;
    }

    /// Queues work after everything queued before it on this stream, after `deps`, and after
    /// what the legacy-stream rules order it after. Returns its completion.
    pub fn enqueue(
        self: &Arc<Self>,
        work: Work,
        mut deps: Vec<Arc<Completion>>,
    ) -> Arc<Completion> {
        let ctx = self.context.clone();
        let _order = lock(&ctx.enqueue_lock);
        match self.kind {
            StreamKind::Legacy => {
                for s in ctx.streams() {
                    if s.kind != StreamKind::Legacy && s.is_blocking() {
                        deps.push(s.tail());
                    }
                }
            }
            _ if self.is_blocking() => {
                if let Some(legacy) = ctx.legacy_if_used() {
                    deps.push(legacy.tail());
                }
            }
            _ => {}
        }
        deps.retain(|d| !d.is_done());
        let done = Arc::new(Completion::new());
        let mut inner = lock(&self.inner);
        inner.queue.push_back(Queued {
            work,
            deps,
            done: done.clone(),
        });
        inner.tail = done.clone();
        if !inner.worker {
            inner.worker = true;
            let me = self.clone();
            std::thread::Builder::new()
                .name(format!("emu-stream-{:x}", self.handle))
                .spawn(move || me.work_loop())
                .unwrap_or_else(|e| {
                    crate::diag::fatal(format!("cannot start a stream worker: {e}"))
                });
        }
        self.cv.notify_all();
        done
    }

    fn work_loop(self: Arc<Self>) {
        loop {
            let next = {
                let mut inner = lock(&self.inner);
                loop {
                    if let Some(q) = inner.queue.pop_front() {
                        break Some(q);
                    }
                    if inner.retired {
                        inner.worker = false;
                        break None;
                    }
                    inner = self.cv.wait(inner).unwrap_or_else(|p| p.into_inner());
                }
            };
            let Some(q) = next else { return };
            for d in &q.deps {
                d.wait();
            }
            crate::diag::boundary("stream work", || q.work.run(&Exec { stream: &self }));
            q.done.complete();
        }
    }
}

/// Retires a stream: it takes no more work, and its worker exits once the queue is empty
/// (pending work still runs, as cuStreamDestroy lets it).
pub fn retire(stream: &Arc<Stream>) {
    registry().remove(stream.handle);
    let mut inner = lock(&stream.inner);
    inner.retired = true;
    stream.cv.notify_all();
}

/// `cuStreamCreate`: a stream in the current context.
pub fn create(flags: u32, priority: i32) -> CuResult<Arc<Stream>> {
    let ctx = context::current()?;
    if flags & !NON_BLOCKING != 0 {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let s = Stream::new(ctx.clone(), StreamKind::Created, flags, priority);
    ctx.add_stream(&s);
    registry().insert(s.handle, s.clone());
    Ok(s)
}

/// `cuStreamDestroy`.
pub fn destroy(handle: usize) -> CuResult<()> {
    let s = registry()
        .get(handle)
        .ok_or(crate::errors::CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))?;
    if s.capture().is_some() {
        // Destroying a capturing stream invalidates its capture (and is itself illegal).
        if let Some(c) = s.capture() {
            c.invalidate("its stream was destroyed during capture");
        }
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    retire(&s);
    Ok(())
}

/// Resolves a stream handle: NULL and `CU_STREAM_LEGACY` are the current context's legacy
/// stream, `CU_STREAM_PER_THREAD` this thread's stream in the current context.
pub fn resolve(handle: usize) -> CuResult<Arc<Stream>> {
    match handle {
        0 | LEGACY_HANDLE => Ok(context::current()?.legacy_stream()),
        PER_THREAD_HANDLE => Ok(context::current()?.per_thread_stream()),
        h => {
            let s = registry()
                .get(h)
                .ok_or(crate::errors::CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))?;
            if !s.context.is_active() {
                return err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
            }
            Ok(s)
        }
    }
}

/// Resolves a stream handle in a given context (the NCCL communicator's, for NULL).
pub fn resolve_in(handle: usize, ctx: &Arc<Context>) -> CuResult<Arc<Stream>> {
    match handle {
        0 | LEGACY_HANDLE => Ok(ctx.legacy_stream()),
        PER_THREAD_HANDLE => Ok(ctx.per_thread_stream()),
        h => resolve(h),
    }
}

/// Submits stream work from an API call: recorded when the stream is being captured, else
/// queued. Queuing on the legacy stream while a blocking stream of its context is being
/// captured would make the capture depend on uncaptured work: CUDA refuses it with
/// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidates that capture.
pub fn submit(stream: &Arc<Stream>, work: Work) -> CuResult<()> {
    if let Some(c) = stream.capture() {
        return capture::record(&c, stream, work);
    }
    if stream.kind == StreamKind::Legacy {
        capture::check_legacy_use(&stream.context)?;
    }
    stream.enqueue(work, Vec::new());
    Ok(())
}
