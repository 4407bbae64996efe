//! Stream capture: while a stream is captured its work is recorded into a graph instead of run,
//! and CUDA's rules about what may not happen meanwhile are enforced exactly: potentially unsafe
//! calls from a thread that is not in relaxed mode fail and invalidate the capture
//! (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED from the capturing thread,
//! CUDA_ERROR_STREAM_CAPTURE_IMPLICIT from another thread during a global-mode capture), work on
//! the legacy stream may not depend on a capturing blocking stream, a capture may not wait on
//! work outside it (CUDA_ERROR_STREAM_CAPTURE_ISOLATION), and streams forked into it must be
//! joined back before it ends (CUDA_ERROR_STREAM_CAPTURE_UNJOINED).
//!
//! The recorded work keeps its capture order; a launch replays it in that order on one stream
//! (a valid schedule of the captured dependency graph, with less concurrency than a GPU).

use crate::context::Context;
use crate::errors::{err, CuResult};
use crate::event::CapturedPoint;
use crate::handles::lock;
use crate::stream::{Stream, StreamKind, Work};
use cudarc::driver::sys::CUresult;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

pub const MODE_GLOBAL: u32 = 0;
pub const MODE_THREAD_LOCAL: u32 = 1;
pub const MODE_RELAXED: u32 = 2;

struct Member {
    stream: Arc<Stream>,
    /// Nodes recorded on this stream so far.
    recorded: usize,
    /// `recorded` when the origin stream last waited on an event recorded on it.
    joined: usize,
}

struct State {
    nodes: Vec<Work>,
    invalid: Option<String>,
    ended: bool,
    members: Vec<Member>,
}

/// One capture sequence.
pub struct Capture {
    pub id: u64,
    pub mode: u32,
    pub thread: ThreadId,
    pub origin: usize,
    pub context: usize,
    state: Mutex<State>,
}

fn active() -> &'static Mutex<Vec<Arc<Capture>>> {
    static ACTIVE: OnceLock<Mutex<Vec<Arc<Capture>>>> = OnceLock::new();
    ACTIVE.get_or_init(|| Mutex::new(Vec::new()))
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_MODE: Cell<u32> = const { Cell::new(MODE_GLOBAL) };
}

impl Capture {
    pub fn is_active(&self) -> bool {
        !lock(&self.state).ended
    }

    pub fn is_invalidated(&self) -> bool {
        lock(&self.state).invalid.is_some()
    }

    /// Marks the capture invalid: its end returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
    pub fn invalidate(&self, why: &str) {
        let mut st = lock(&self.state);
        if st.invalid.is_none() {
            st.invalid = Some(why.to_string());
        }
    }
}

/// `cuThreadExchangeStreamCaptureMode`.
pub fn exchange_mode(mode: u32) -> CuResult<u32> {
    if mode > MODE_RELAXED {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(THREAD_MODE.with(|m| m.replace(mode)))
}

/// `cuStreamBeginCapture`.
pub fn begin(stream: &Arc<Stream>, mode: u32) -> CuResult<()> {
    if mode > MODE_RELAXED {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if stream.kind == StreamKind::Legacy {
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    if stream.capture().is_some() {
        return err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    let c = Arc::new(Capture {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        mode,
        thread: std::thread::current().id(),
        origin: stream.handle,
        context: stream.context.handle,
        state: Mutex::new(State {
            nodes: Vec::new(),
            invalid: None,
            ended: false,
            members: vec![Member {
                stream: stream.clone(),
                recorded: 0,
                joined: 0,
            }],
        }),
    });
    stream.set_capture(Some(c.clone()));
    lock(active()).push(c);
    Ok(())
}

fn finish(c: &Capture) -> Vec<Work> {
    let mut st = lock(&c.state);
    st.ended = true;
    for m in &st.members {
        m.stream.set_capture(None);
    }
    lock(active()).retain(|a| a.id != c.id);
    std::mem::take(&mut st.nodes)
}

/// `cuStreamEndCapture`: the recorded work, or why there is none.
pub fn end(stream: &Arc<Stream>) -> CuResult<Vec<Work>> {
    let Some(c) = stream.capture() else {
        return err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    };
    if c.origin != stream.handle {
        c.invalidate("cuStreamEndCapture was called on a stream that joined it");
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    }
    if c.mode == MODE_THREAD_LOCAL && c.thread != std::thread::current().id() {
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    }
    let (invalid, unjoined) = {
        let st = lock(&c.state);
        let unjoined = st
            .members
            .iter()
            .any(|m| m.stream.handle != c.origin && m.recorded > m.joined);
        (st.invalid.clone(), unjoined)
    };
    let nodes = finish(&c);
    if invalid.is_some() {
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    if unjoined {
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
    }
    Ok(nodes)
}

/// Records work submitted to a capturing stream.
pub fn record(c: &Arc<Capture>, stream: &Arc<Stream>, work: Work) -> CuResult<()> {
    let mut st = lock(&c.state);
    if st.invalid.is_some() {
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    st.nodes.push(work);
    if let Some(m) = st
        .members
        .iter_mut()
        .find(|m| m.stream.handle == stream.handle)
    {
        m.recorded += 1;
    }
    Ok(())
}

/// Nodes recorded on `stream` so far (an event's position when recorded in the capture).
pub fn position(c: &Arc<Capture>, stream: &Arc<Stream>) -> CuResult<usize> {
    let st = lock(&c.state);
    if st.invalid.is_some() {
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    Ok(st
        .members
        .iter()
        .find(|m| m.stream.handle == stream.handle)
        .map_or(0, |m| m.recorded))
}

/// `cuStreamWaitEvent` on an event recorded in an active capture: joins `stream` into that
/// capture (or, for its origin stream, joins the event's stream back).
pub fn wait_on_point(stream: &Arc<Stream>, p: &CapturedPoint) -> CuResult<()> {
    match stream.capture() {
        Some(mine) if mine.id != p.capture.id => {
            mine.invalidate("it waited on an event of another capture");
            p.capture
                .invalidate("another capture waited on an event recorded in it");
            err(CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE)
        }
        Some(mine) => {
            let mut st = lock(&mine.state);
            if st.invalid.is_some() {
                return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            if stream.handle == mine.origin {
                if let Some(m) = st.members.iter_mut().find(|m| m.stream.handle == p.stream) {
                    m.joined = m.joined.max(p.position);
                }
            }
            Ok(())
        }
        None => {
            if stream.context.handle != p.capture.context {
                return err(CUresult::CUDA_ERROR_INVALID_HANDLE);
            }
            let mut st = lock(&p.capture.state);
            if st.invalid.is_some() {
                return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            st.members.push(Member {
                stream: stream.clone(),
                recorded: 0,
                joined: 0,
            });
            stream.set_capture(Some(p.capture.clone()));
            Ok(())
        }
    }
}

/// `cuStreamIsCapturing` / `cuStreamGetCaptureInfo`: (status, capture id).
pub fn status(stream: &Stream) -> (u32, u64) {
    match stream.capture() {
        None => (0, 0),
        Some(c) if c.is_invalidated() => (2, c.id),
        Some(c) => (1, c.id),
    }
}

/// The rule for potentially unsafe calls (allocation, synchronous copies, module loading,
/// context synchronization…): a thread in relaxed mode may always make them; a thread with its
/// own non-relaxed capture going on may not (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, the capture
/// is invalidated); a thread in global mode may not while another thread runs a global-mode
/// capture (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, that capture is invalidated).
pub fn check_unsafe_call(api: &str) -> CuResult<()> {
    let mode = THREAD_MODE.get();
    if mode == MODE_RELAXED {
        return Ok(());
    }
    let me = std::thread::current().id();
    let captures = lock(active()).clone();
    if let Some(c) = captures
        .iter()
        .find(|c| c.thread == me && c.mode != MODE_RELAXED)
    {
        c.invalidate(&format!("{api} was called by the capturing thread"));
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    if mode == MODE_GLOBAL {
        if let Some(c) = captures
            .iter()
            .find(|c| c.thread != me && c.mode == MODE_GLOBAL)
        {
            c.invalidate(&format!(
                "{api} was called by another thread during a global-mode capture"
            ));
            return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
        }
    }
    Ok(())
}

/// Work on the legacy stream would depend on every blocking stream of its context, so it is
/// refused while one of them is being captured.
pub fn check_legacy_use(ctx: &Context) -> CuResult<()> {
    let captures = lock(active()).clone();
    for c in captures.iter().filter(|c| c.context == ctx.handle) {
        let blocking = lock(&c.state)
            .members
            .iter()
            .any(|m| m.stream.is_blocking());
        if blocking {
            c.invalidate("the legacy stream was used while it captured a blocking stream");
            return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
        }
    }
    Ok(())
}

/// Synchronizing a context or device while one of its streams is captured is illegal: the
/// capture is invalidated and the call fails.
pub fn check_context_sync(ctx: &Context) -> CuResult<()> {
    check_unsafe_call("cuCtxSynchronize")?;
    let captures = lock(active()).clone();
    if let Some(c) = captures.iter().find(|c| c.context == ctx.handle) {
        c.invalidate("its context was synchronized");
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

/// Synchronizing or querying a capturing stream is illegal in every mode.
pub fn check_stream_sync(stream: &Stream) -> CuResult<()> {
    if let Some(c) = stream.capture() {
        c.invalidate("the capturing stream was synchronized or queried");
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}
