//! Events: a record marks a point in a stream; waits, queries and synchronizations look at the
//! most recent record. An event recorded in a capturing stream stands for a point in the capture
//! instead (capture.rs).

use crate::capture::{self, Capture};
use crate::completion::Completion;
use crate::errors::{err, CuError, CuResult};
use crate::handles::{self, lock, Registry};
use crate::stream::{self, Work};
use cudarc::driver::sys::CUresult;
use std::sync::{Arc, Mutex, OnceLock};

/// `CU_EVENT_DISABLE_TIMING`.
pub const DISABLE_TIMING: u32 = 2;

/// A point recorded inside a capture.
#[derive(Clone)]
pub struct CapturedPoint {
    pub capture: Arc<Capture>,
    pub stream: usize,
    /// Nodes recorded on that stream so far.
    pub position: usize,
}

#[derive(Default)]
struct State {
    record: Option<Arc<Completion>>,
    captured: Option<CapturedPoint>,
}

pub struct Event {
    pub handle: usize,
    pub context: usize,
    pub flags: u32,
    state: Mutex<State>,
}

fn registry() -> &'static Registry<Event> {
    static R: OnceLock<Registry<Event>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

pub fn create(flags: u32) -> CuResult<Arc<Event>> {
    let ctx = crate::context::current()?;
    if flags & !0xf != 0 {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let e = Arc::new(Event {
        handle: handles::next(),
        context: ctx.handle,
        flags,
        state: Mutex::new(State::default()),
    });
    registry().insert(e.handle, e.clone());
    Ok(e)
}

pub fn get(handle: usize) -> CuResult<Arc<Event>> {
    registry()
        .get(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))
}

pub fn destroy(handle: usize) -> CuResult<()> {
    registry()
        .remove(handle)
        .map(|_| ())
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))
}

/// Forgets the events of a context that ends.
pub fn retire_context(context: usize) {
    for e in registry().all() {
        if e.context == context {
            registry().remove(e.handle);
        }
    }
}

/// `cuEventRecord`.
pub fn record(event: &Arc<Event>, stream_handle: usize) -> CuResult<()> {
    let s = stream::resolve(stream_handle)?;
    if s.context.handle != event.context {
        return err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    if let Some(c) = s.capture() {
        let position = capture::position(&c, &s)?;
        let mut st = lock(&event.state);
        st.captured = Some(CapturedPoint {
            capture: c,
            stream: s.handle,
            position,
        });
        st.record = None;
        return Ok(());
    }
    if s.kind == stream::StreamKind::Legacy {
        capture::check_legacy_use(&s.context)?;
    }
    let done = s.enqueue(Work::Nop, Vec::new());
    let mut st = lock(&event.state);
    st.record = Some(done);
    st.captured = None;
    Ok(())
}

/// Fails (and invalidates the capture) when the event was last recorded in a capture that is
/// still going on: it stands for no work that could complete.
fn check_not_captured(event: &Event) -> CuResult<()> {
    let captured = lock(&event.state).captured.clone();
    if let Some(p) = captured {
        if p.capture.is_active() {
            p.capture
                .invalidate("an event recorded in it was queried or synchronized");
            return err(CUresult::CUDA_ERROR_CAPTURED_EVENT);
        }
    }
    Ok(())
}

/// `cuEventQuery`.
pub fn query(event: &Event) -> CuResult<()> {
    check_not_captured(event)?;
    match lock(&event.state).record.clone() {
        Some(r) if !r.is_done() => err(CUresult::CUDA_ERROR_NOT_READY),
        _ => Ok(()),
    }
}

/// `cuEventSynchronize`.
pub fn synchronize(event: &Event) -> CuResult<()> {
    check_not_captured(event)?;
    let record = lock(&event.state).record.clone();
    if let Some(r) = record {
        r.wait();
    }
    crate::context::get(event.context)?.sticky_error()
}

/// `cuEventElapsedTime`, in milliseconds.
pub fn elapsed(start: &Event, end: &Event) -> CuResult<f32> {
    if (start.flags | end.flags) & DISABLE_TIMING != 0 {
        return err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    let (Some(a), Some(b)) = (
        lock(&start.state).record.clone(),
        lock(&end.state).record.clone(),
    ) else {
        return err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    };
    match (a.time(), b.time()) {
        (Some(a), Some(b)) => Ok(if b >= a {
            (b - a).as_secs_f32() * 1e3
        } else {
            -((a - b).as_secs_f32() * 1e3)
        }),
        _ => err(CUresult::CUDA_ERROR_NOT_READY),
    }
}

/// `cuStreamWaitEvent`: later work on the stream waits for the event's most recent record. A
/// record made in a capture joins the waiting stream into that capture.
pub fn wait(stream_handle: usize, event: &Arc<Event>) -> CuResult<()> {
    let s = stream::resolve(stream_handle)?;
    let (record, captured) = {
        let st = lock(&event.state);
        (st.record.clone(), st.captured.clone())
    };
    if let Some(p) = captured.filter(|p| p.capture.is_active()) {
        return capture::wait_on_point(&s, &p);
    }
    if let Some(c) = s.capture() {
        // A capture may only depend on work inside it.
        c.invalidate("it waited on an event recorded outside the capture");
        return err(CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    }
    if s.kind == stream::StreamKind::Legacy {
        capture::check_legacy_use(&s.context)?;
    }
    s.enqueue(Work::Nop, record.into_iter().collect());
    Ok(())
}
