//! Calls with a deadline (docs/resilience.md): no call of a plan waits past it on a surviving
//! rank, neither its host thread nor its stream.
//!
//! A call with a deadline registers with the library's watchdog (one thread per process) before
//! its first NCCL operation, marks its stream with events (its start, after the fingerprint
//! exchange, after each round's group, its end) and returns once its work is enqueued, as any
//! call. The watchdog polls those events and the communicator's asynchronous error. The call
//! completes when its end event has; it fails when NCCL reports an asynchronous error, or when
//! its deadline passes first: counted from the moment its stream reaches its work (work queued
//! before it on the stream is not the call's), or, while its host thread is still inside the
//! call, from the call's entry. A failure revokes the communicator (`ncclCommRevoke`; with an
//! NCCL older than 2.28.7, `ncclCommAbort`, which ends it), so every operation pending on it
//! ends, on every rank whose own deadline passes, and the stream goes on with what follows.
//! Nothing is posted on a revoked communicator again: each group checks, under the
//! communicator's post lock that the watchdog takes before it revokes.
//!
//! The outcome is per communicator: `ncclReshardCommGetStatus` (`ncclInProgress`, success, or
//! the failure) and `ncclReshardCommWait`. A failure says what did not complete, with which
//! peers (from the plan: the stage's peers), and what to do next.

use super::library::{Nccl, NcclComm, NCCL_REMOTE_ERROR};
use crate::debug::{self, Level};
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::{Device, Event};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

/// The deadline of a call: `configured` milliseconds (the config's `timeoutMs`; 0: none), or when
/// it is unset, `NCCL_RESHARD_TIMEOUT_MS` (unset or 0: none).
pub fn resolve(configured: Option<u64>) -> Option<Duration> {
    let ms = configured.unwrap_or_else(|| {
        std::env::var("NCCL_RESHARD_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    });
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// A communicator's (rank, size, device), which tell two communicators at one address apart.
pub(crate) type Identity = (i32, i32, i32);

/// How often the watchdog looks while calls are pending: the deadline is met within this much
/// (plus the revoke itself).
pub const TICK: Duration = Duration::from_millis(2);

#[derive(Clone, Debug, PartialEq)]
enum State {
    Running,
    Completed,
    Failed(Error),
}

/// One call with a deadline.
struct Call {
    rank: u32,
    /// The call's number on its communicator, from 1 (for messages).
    number: u64,
    timeout: Duration,
    entered: Instant,
    device: Arc<Device>,
    inner: Mutex<CallInner>,
}

struct CallInner {
    state: State,
    /// The host thread has left the call (its end is marked).
    left: bool,
    /// The first point of the call's work on its stream, and when the watchdog saw it passed.
    start: Option<Event>,
    stream_started: Option<Instant>,
    /// Stages in stream order, each with what it waits for; the last one of a call that has
    /// been left is its end.
    marks: Vec<(Event, String)>,
    /// What the host thread is posting now (what a host-side wait waits for).
    posting: String,
}

impl Call {
    fn inner(&self) -> MutexGuard<'_, CallInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the library knows of one communicator it watches calls on.
struct CommState {
    comm: usize,
    /// (rank, size, device) when first seen: another communicator made later at the same
    /// address is told apart by them.
    identity: Identity,
    nccl: &'static Nccl,
    /// Set, under `post`, before the communicator is revoked: no group is posted after.
    revoked: AtomicBool,
    post: Mutex<()>,
    inner: Mutex<CommInner>,
    changed: Condvar,
}

#[derive(Default)]
struct CommInner {
    calls: Vec<Arc<Call>>,
    next: u64,
    /// The first failure, kept until the communicator is shrunk through the library.
    failure: Option<Error>,
    /// The fallback ended the communicator (`ncclCommAbort`): its handle is gone.
    aborted: bool,
}

impl CommState {
    fn inner(&self) -> MutexGuard<'_, CommInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn comms() -> MutexGuard<'static, HashMap<usize, Arc<CommState>>> {
    static COMMS: OnceLock<Mutex<HashMap<usize, Arc<CommState>>>> = OnceLock::new();
    COMMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The watchdog's wake-up: a call was registered.
fn wake() -> &'static (Mutex<bool>, Condvar) {
    static WAKE: OnceLock<(Mutex<bool>, Condvar)> = OnceLock::new();
    WAKE.get_or_init(|| (Mutex::new(false), Condvar::new()))
}

/// A call being made with a deadline; dropped without [`Guard::leave`] (a call refused before
/// its first NCCL operation), the call leaves no trace.
pub(crate) struct Guard {
    comm: Arc<CommState>,
    call: Arc<Call>,
    left: bool,
}

/// The refusal of a call on a communicator the library has revoked (or aborted).
fn revoked_error(comm: usize, failure: Option<&Error>, aborted: bool) -> Error {
    Error::invalid_usage(format!(
        "comm {comm:#x} was {} by libncclreshard after a call with a deadline failed{}; nothing may be posted on it: {}",
        if aborted { "aborted (ncclCommAbort)" } else { "revoked (ncclCommRevoke)" },
        failure.map_or_else(String::new, |f| format!(" ({})", f.message)),
        if aborted {
            "create a new communicator (ncclCommInitRank) and the survivors' plan"
        } else {
            "shrink it (ncclReshardCommShrink) and call the survivors' plan on the new communicator"
        }
    ))
}

impl Guard {
    /// Registers a call of rank `rank` on `comm` (whose size and device are `identity`) with
    /// a deadline of `timeout`, or refuses it when the library has revoked `comm`.
    pub fn begin(
        nccl: &'static Nccl,
        comm: NcclComm,
        rank: u32,
        identity: Identity,
        timeout: Duration,
        device: Arc<Device>,
    ) -> Result<Guard> {
        let key = comm as usize;
        let state = {
            let mut comms = comms();
            // A record of another communicator that was made at the same address later.
            if let Some(old) = comms.get(&key) {
                let stale = !old.inner().aborted && old.identity != identity;
                if stale {
                    comms.remove(&key);
                }
            }
            comms
                .entry(key)
                .or_insert_with(|| {
                    Arc::new(CommState {
                        comm: key,
                        identity,
                        nccl,
                        revoked: AtomicBool::new(false),
                        post: Mutex::new(()),
                        inner: Mutex::new(CommInner::default()),
                        changed: Condvar::new(),
                    })
                })
                .clone()
        };
        let call = {
            let mut inner = state.inner();
            if state.revoked.load(Ordering::Acquire) {
                return Err(revoked_error(key, inner.failure.as_ref(), inner.aborted));
            }
            inner.next += 1;
            let call = Arc::new(Call {
                rank,
                number: inner.next,
                timeout,
                entered: Instant::now(),
                device,
                inner: Mutex::new(CallInner {
                    state: State::Running,
                    left: false,
                    start: None,
                    stream_started: None,
                    marks: Vec::new(),
                    posting: "its first NCCL operation".into(),
                }),
            });
            inner.calls.push(call.clone());
            call
        };
        start_watchdog();
        let (lock, cv) = wake();
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_one();
        Ok(Guard {
            comm: state,
            call,
            left: false,
        })
    }

    /// True once the communicator is revoked: post nothing more.
    pub fn revoked(&self) -> bool {
        self.comm.revoked.load(Ordering::Acquire)
    }

    /// Held while a group's operations are posted (not while it is ended, which may wait): the
    /// watchdog takes it before revoking, so a group is either posted whole before the revoke
    /// or not at all.
    pub fn post_lock(&self) -> MutexGuard<'_, ()> {
        self.comm.post.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error a call returns when its communicator was revoked while it was posting.
    pub fn revoked_error(&self) -> Error {
        let call = self.call.inner();
        match &call.state {
            State::Failed(e) => e.clone(),
            _ => {
                let inner = self.comm.inner();
                revoked_error(self.comm.comm, inner.failure.as_ref(), inner.aborted)
            }
        }
    }

    /// Marks the start of the call's work on `stream` (device context current).
    pub fn mark_start(&self, stream: sys::CUstream) -> Result<()> {
        let event = self.call.device.event()?;
        event.record(stream)?;
        self.call.inner().start = Some(event);
        Ok(())
    }

    /// Says what the host thread posts next (`stage`: what it waits for).
    pub fn posting(&self, stage: &str) {
        stage.clone_into(&mut self.call.inner().posting);
    }

    /// Marks the end of a stage on `stream`: what comes after it waits for `stage`.
    pub fn mark(&self, stream: sys::CUstream, stage: String) -> Result<()> {
        let event = self.call.device.event()?;
        event.record(stream)?;
        self.call.inner().marks.push((event, stage));
        Ok(())
    }

    /// The host thread leaves the call: its end is marked on `stream`, and the watchdog decides
    /// its outcome from here.
    pub fn leave(mut self, stream: sys::CUstream) -> Result<()> {
        self.left = true;
        let marked = self.mark(stream, "the end of the call's work".into());
        self.call.inner().left = true;
        marked
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.left {
            return;
        }
        // Refused before any NCCL operation: forgotten.
        let mut inner = self.comm.inner();
        inner.calls.retain(|c| !Arc::ptr_eq(c, &self.call));
        let mut call = self.call.inner();
        if call.state == State::Running {
            call.state = State::Completed;
        }
        let events = std::mem::take(&mut call.marks).into_iter().map(|(e, _)| e);
        self.call
            .device
            .give_back_events(events.chain(call.start.take()));
        drop(call);
        drop(inner);
        self.comm.changed.notify_all();
    }
}

fn start_watchdog() {
    static START: Once = Once::new();
    START.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("ncclreshard-deadline".into())
            .spawn(watch);
        if let Err(e) = spawned {
            debug::log(Level::Warn, || {
                format!("cannot start the deadline watchdog: {e}")
            });
        }
    });
}

fn watch() {
    loop {
        let states: Vec<Arc<CommState>> = comms().values().cloned().collect();
        let pending = states.iter().any(|s| !s.inner().calls.is_empty());
        if !pending {
            let (lock, cv) = wake();
            let mut woken = lock.lock().unwrap_or_else(|p| p.into_inner());
            while !*woken {
                woken = cv
                    .wait_timeout(woken, Duration::from_millis(100))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
            *woken = false;
            continue;
        }
        for state in &states {
            check(state);
        }
        // Healthy communicators with nothing pending are forgotten.
        comms().retain(|_, s| {
            let inner = s.inner();
            !inner.calls.is_empty() || inner.failure.is_some()
        });
        std::thread::sleep(TICK);
    }
}

/// Retires the calls that are over: those completed (left by their host thread, every mark
/// passed) or failed. The watchdog does it each tick, and a caller asking for the outcome does
/// it first, so that an outcome never waits for the next tick.
fn reap(state: &Arc<CommState>) {
    let mut over = Vec::new();
    let mut inner = state.inner();
    inner.calls.retain(|call| {
        let mut c = call.inner();
        if c.state == State::Running
            && c.left
            && c.marks.iter().all(|(e, _)| e.is_done().unwrap_or(false))
        {
            c.state = State::Completed;
        }
        let done = c.state != State::Running;
        if done {
            let events = std::mem::take(&mut c.marks).into_iter().map(|(e, _)| e);
            over.push((
                call.device.clone(),
                events.chain(c.start.take()).collect::<Vec<_>>(),
            ));
        }
        !done
    });
    drop(inner);
    if !over.is_empty() {
        for (device, events) in over {
            device.give_back_events(events);
        }
        state.changed.notify_all();
    }
}

/// One look at a communicator's calls.
fn check(state: &Arc<CommState>) {
    reap(state);
    let calls = state.inner().calls.clone();
    if calls.is_empty() {
        return;
    }
    let now = Instant::now();
    let mut failure: Option<(Arc<Call>, String)> = None;
    for call in &calls {
        let mut inner = call.inner();
        if inner.state != State::Running {
            continue;
        }
        if inner.stream_started.is_none()
            && inner
                .start
                .as_ref()
                .is_some_and(|e| e.is_done().unwrap_or(false))
        {
            inner.stream_started = Some(now);
        }
        // The first stage not passed yet (the marks pass in order).
        let pending = inner
            .marks
            .iter()
            .position(|(e, _)| !e.is_done().unwrap_or(false));
        if inner.left && pending.is_none() {
            continue; // completed since the reap: the next one retires it
        }
        let deadline = match inner.stream_started {
            Some(started) => Some(started + call.timeout),
            None if !inner.left => Some(call.entered + call.timeout),
            // Queued behind the caller's earlier work: not the call's time yet.
            None => None,
        };
        if failure.is_none() && deadline.is_some_and(|d| now >= d) {
            let waiting = match pending {
                Some(i) => inner.marks[i].1.clone(),
                None => format!("the host thread, still posting {}", inner.posting),
            };
            failure = Some((call.clone(), waiting));
        }
    }
    if let Some((call, waiting)) = failure {
        let why = format!(
            "did not complete within its deadline of {} ms (config.timeoutMs, NCCL_RESHARD_TIMEOUT_MS): {waiting} had not completed",
            call.timeout.as_millis()
        );
        revoke(state, Some((call.number, call.rank)), &why);
    } else {
        let mut async_error = 0;
        // SAFETY: a communicator the caller passed to a call that is still running.
        let queried =
            unsafe { (state.nccl.comm_get_async_error)(state.comm as NcclComm, &mut async_error) };
        if queried == 0 && async_error != 0 && async_error != 7 {
            let call = calls
                .iter()
                .find(|c| c.inner().state == State::Running)
                .cloned();
            if let Some(call) = call {
                let waiting = {
                    let inner = call.inner();
                    inner
                        .marks
                        .iter()
                        .find(|(e, _)| !e.is_done().unwrap_or(false))
                        .map_or_else(|| inner.posting.clone(), |(_, s)| s.clone())
                };
                // SAFETY: NCCL returns a static string.
                let text =
                    unsafe { std::ffi::CStr::from_ptr((state.nccl.get_error_string)(async_error)) }
                        .to_string_lossy()
                        .into_owned();
                let why = format!(
                    "failed: NCCL reported an asynchronous error on the communicator ({async_error}: {text}) while {waiting} had not completed"
                );
                revoke(state, Some((call.number, call.rank)), &why);
            }
        }
    }
    reap(state);
}

/// Ends every call on the communicator: revokes it (once; or aborts it where NCCL has no
/// revoke) so every operation pending on it ends, and fails its running calls with what
/// happened and what to do next. `why` is said of `culprit` (the call's number and rank), or
/// of the application's revoke when there is none.
fn revoke(state: &Arc<CommState>, culprit: Option<(u64, u32)>, why: &str) {
    {
        let _posting = state.post.lock().unwrap_or_else(|p| p.into_inner());
        if state.revoked.swap(true, Ordering::AcqRel) {
            return;
        }
    }
    let nccl = state.nccl;
    let comm = state.comm as NcclComm;
    let (how, aborted) = match nccl.comm_revoke {
        Some(revoke) => {
            // SAFETY: the caller's communicator; revoking may run beside another thread's
            // ncclGroupEnd on it (it is what ends a wait there).
            let result = unsafe { revoke(comm, 0) };
            let how = match result {
                0 | 7 => "revoked the communicator (ncclCommRevoke)".to_string(),
                r => format!("tried to revoke the communicator (ncclCommRevoke returned {r})"),
            };
            (how, false)
        }
        None => {
            // SAFETY: as above; the handle is gone afterwards.
            let result = unsafe { (nccl.comm_abort)(comm) };
            (
                format!(
                    "aborted the communicator (ncclCommAbort returned {result}; NCCL {} has no ncclCommRevoke, which came with 2.28.7): it is gone",
                    nccl.version_text()
                ),
                true,
            )
        }
    };
    let next = if aborted {
        "create a new communicator of the survivors (ncclCommInitRank), create the survivors' plan (config.failedRanks) and call again"
    } else {
        "agree with the other survivors on the failed ranks, shrink the communicator (ncclReshardCommShrink with them), create the survivors' plan (config.failedRanks) and call again on the new communicator"
    };
    let report = |(number, rank): (u64, u32), what: &str| {
        Error {
        kind: ErrorKind::Nccl(NCCL_REMOTE_ERROR),
        message: format!(
            "ncclReshard on rank {rank} (call #{number} in flight on its communicator) {what}; the library {how}, so every operation pending on the communicator ended and work enqueued after the call runs; the destination views of the calls on it hold undefined bytes. Next: {next}; a successful call rewrites every destination byte"
        ),
    }
    };
    let first = match culprit {
        Some(c) => report(c, why),
        None => Error {
            kind: ErrorKind::Nccl(NCCL_REMOTE_ERROR),
            message: format!(
                "comm {:#x} was revoked by ncclReshardCommRevoke: the library {how}. Next: {next}",
                state.comm
            ),
        },
    };
    debug::log(Level::Warn, || first.message.clone());
    let mut inner = state.inner();
    inner.aborted = aborted;
    for c in &inner.calls {
        let mut ci = c.inner();
        if ci.state == State::Running {
            let own = culprit == Some((c.number, c.rank));
            ci.state = State::Failed(match culprit {
                Some(_) if own => first.clone(),
                Some((number, _)) => report(
                    (c.number, c.rank),
                    &format!("ended because call #{number} on the same communicator {why}"),
                ),
                None => report((c.number, c.rank), "was ended by ncclReshardCommRevoke"),
            });
        }
    }
    inner.failure.get_or_insert(first);
    drop(inner);
    state.changed.notify_all();
}

/// The outcome of the calls with a deadline on `comm`: `Ok(true)` when none is running and
/// none failed, `Ok(false)` while one is running, the failure once one failed.
pub fn status(comm: NcclComm) -> Result<bool> {
    let state = comms().get(&(comm as usize)).cloned();
    let Some(state) = state else {
        return Ok(true);
    };
    reap(&state);
    let inner = state.inner();
    if let Some(failure) = &inner.failure {
        return Err(failure.clone());
    }
    Ok(!running(&inner))
}

fn running(inner: &CommInner) -> bool {
    inner
        .calls
        .iter()
        .any(|c| c.inner().state == State::Running)
}

/// Waits until no call with a deadline is running on `comm` (each ends by its deadline plus
/// the revoke), then returns its outcome as [`status`] does.
pub fn wait(comm: NcclComm) -> Result<()> {
    let state = comms().get(&(comm as usize)).cloned();
    let Some(state) = state else {
        return Ok(());
    };
    loop {
        reap(&state);
        let inner = state.inner();
        if let Some(failure) = &inner.failure {
            return Err(failure.clone());
        }
        if !running(&inner) {
            return Ok(());
        }
        // Woken by the watchdog's verdict, or looks again itself a tick later.
        drop(state.changed.wait_timeout(inner, TICK));
    }
}

/// Revokes `comm` now (the application found a rank dead), failing its running calls.
pub fn revoke_now(nccl: &'static Nccl, comm: NcclComm) -> Result<()> {
    let key = comm as usize;
    let state = comms()
        .entry(key)
        .or_insert_with(|| {
            Arc::new(CommState {
                comm: key,
                identity: (-1, -1, -1),
                nccl,
                revoked: AtomicBool::new(false),
                post: Mutex::new(()),
                inner: Mutex::new(CommInner::default()),
                changed: Condvar::new(),
            })
        })
        .clone();
    revoke(&state, None, "");
    Ok(())
}

/// Refuses a call on a communicator the library aborted (its handle is gone: nothing may ask
/// NCCL about it).
pub fn refuse_aborted(comm: NcclComm) -> Result<()> {
    let state = comms().get(&(comm as usize)).cloned();
    match state {
        Some(state) if state.inner().aborted => {
            let inner = state.inner();
            Err(revoked_error(state.comm, inner.failure.as_ref(), true))
        }
        _ => Ok(()),
    }
}

/// Refuses a call on a communicator the library revoked; a record of another communicator
/// once at the same address (told apart by its rank, size and device) is forgotten.
pub fn refuse_revoked(comm: NcclComm, identity: Identity) -> Result<()> {
    let key = comm as usize;
    let mut comms = comms();
    let Some(state) = comms.get(&key).cloned() else {
        return Ok(());
    };
    if state.identity != identity && state.identity != (-1, -1, -1) {
        comms.remove(&key);
        return Ok(());
    }
    if state.revoked.load(Ordering::Acquire) {
        let inner = state.inner();
        return Err(revoked_error(key, inner.failure.as_ref(), inner.aborted));
    }
    Ok(())
}

/// Whether the library revoked or aborted `comm`, and if it aborted it (its handle is gone).
pub fn revoked(comm: NcclComm) -> Option<bool> {
    let state = comms().get(&(comm as usize)).cloned()?;
    let aborted = state.inner().aborted;
    state.revoked.load(Ordering::Acquire).then_some(aborted)
}

/// Forgets `comm` (it was shrunk into a new communicator through the library).
pub fn forget(comm: NcclComm) {
    comms().remove(&(comm as usize));
}
