//! Per-thread NCCL groups. `ncclGroupStart` deepens this thread's group; operations posted while
//! it is open are collected and issued together at the outermost `ncclGroupEnd` (outside a
//! group, each operation is a group of its own). A communicator joins the group of the thread
//! that first posts to it; NCCL forbids using one communicator from two threads at once, and the
//! emulator aborts when it sees that.

use super::comm::{self, Comm};
use super::ops::{self, OpKind, Posted, StreamOp, Template};
use super::{fail, NResult, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, SUCCESS};
use crate::config::config;
use crate::diag;
use crate::handles::lock;
use crate::stream::{self, Stream, Work};
use std::cell::RefCell;
use std::sync::Arc;

#[derive(Default)]
struct Group {
    posted: Vec<Posted>,
    /// Communicators whose init was called inside the group (completed at its end).
    inits: Vec<Arc<Comm>>,
    /// The first error of an operation posted in the group (returned by its end).
    error: Option<(i32, String)>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// This thread's group depth, where NCCL keeps it (`ncclreshard_nccl_api::group_depth`), so
/// that libncclreshard reads it here as it reads NCCL's.
pub fn depth() -> u32 {
    ncclreshard_nccl_api::group_depth()
}

/// `ncclGroupStart`.
pub fn start() {
    ncclreshard_nccl_api::enter_group();
}

/// Defers a communicator's init to the end of the open group.
pub fn defer_init(comm: Arc<Comm>) {
    GROUP.with(|g| g.borrow_mut().inits.push(comm));
}

/// Records an error of a call made inside the group.
pub fn note_error(result: i32, message: &str) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if depth() > 0 && g.error.is_none() {
            g.error = Some((result, message.to_string()));
        }
    });
}

fn claim(comm: &Comm, api: &str) {
    let me = std::thread::current().id();
    let mut owner = lock(&comm.owner);
    match *owner {
        Some(other) if other != me => diag::fatal(format_args!(
            "{api} on {}: communicator used concurrently from two threads (it is part of another thread's open NCCL group); NCCL forbids concurrent use of a communicator",
            comm.describe()
        )),
        _ => *owner = Some(me),
    }
}

/// Posts an operation: collected when a group is open, else issued at once.
pub fn post(comm: &Arc<Comm>, kind: OpKind, stream: usize) -> NResult<i32> {
    if lock(&comm.status).revoked {
        let message = format!(
            "{} on {}: the communicator was revoked (ncclCommRevoke); NCCL returns ncclInvalidUsage for new operations on it and allows only ncclCommDestroy, ncclCommAbort, ncclCommSplit and ncclCommShrink",
            kind.name(),
            comm.describe()
        );
        return Err(diag::strict(
            message.clone(),
            super::NcclError {
                result: INVALID_USAGE,
                message,
            },
        ));
    }
    comm.ensure_ready()?;
    claim(comm, kind.name());
    let posted = Posted {
        comm: comm.clone(),
        kind,
        stream,
    };
    let open = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if depth() > 0 {
            g.posted.push(posted.clone());
            true
        } else {
            false
        }
    });
    if open {
        return Ok(SUCCESS);
    }
    let result = launch(vec![posted], Vec::new());
    *lock(&comm.owner) = None;
    result
}

/// `ncclGroupEnd`.
pub fn end() -> NResult<i32> {
    if !ncclreshard_nccl_api::leave_group()? {
        return Ok(SUCCESS);
    }
    let group = GROUP.with(|g| std::mem::take(&mut *g.borrow_mut()));
    for p in &group.posted {
        *lock(&p.comm.owner) = None;
    }
    if let Some((result, message)) = group.error {
        return fail(result, message);
    }
    launch(group.posted, group.inits)
}

/// The stream an operation runs on: NULL means the legacy stream of the communicator's device.
fn stream_of(p: &Posted) -> NResult<Arc<Stream>> {
    let s = stream::resolve_in(p.stream, &p.comm.context).map_err(|e| super::NcclError {
        result: super::UNHANDLED_CUDA_ERROR,
        message: format!(
            "{}: invalid stream {:#x} ({:?})",
            p.kind.name(),
            p.stream,
            e.0
        ),
    })?;
    if s.context.device != p.comm.device {
        let message = format!(
            "{} on {}: {} is on device {}, not the communicator's device",
            p.kind.name(),
            p.comm.describe(),
            s.name(),
            s.context.device
        );
        return Err(diag::strict(
            message.clone(),
            super::NcclError {
                result: INVALID_ARGUMENT,
                message,
            },
        ));
    }
    Ok(s)
}

/// Issues a group: inits first, then one stream operation per stream (recorded into the
/// capture when the stream is being captured). With a non-blocking communicator involved the
/// issue happens on a helper thread and the call returns ncclInProgress.
fn launch(posted: Vec<Posted>, inits: Vec<Arc<Comm>>) -> NResult<i32> {
    ncclreshard_nccl_api::self_messages_pair_up(
        &posted,
        |p| match p.kind {
            OpKind::Send { peer, .. } if peer == p.comm.rank => Some((p.comm.handle, true)),
            OpKind::Recv { peer, .. } if peer == p.comm.rank => Some((p.comm.handle, false)),
            _ => None,
        },
        |p| format!("{} on {}", p.kind.name(), p.comm.describe()),
    )?;
    // Revoked (by another thread) after its operations were posted in this group and before
    // the group's end: NCCL refuses to launch them.
    if let Some(p) = posted.iter().find(|p| lock(&p.comm.status).revoked) {
        return fail(
            INVALID_USAGE,
            format!(
                "{} on {}: the communicator was revoked before the group was issued",
                p.kind.name(),
                p.comm.describe()
            ),
        );
    }
    let mut streams: Vec<(Arc<Stream>, Vec<Posted>)> = Vec::new();
    for p in posted {
        let s = stream_of(&p)?;
        match streams.iter_mut().find(|(t, _)| t.handle == s.handle) {
            Some((_, list)) => list.push(p),
            None => streams.push((s, vec![p])),
        }
    }
    let nonblocking: Vec<Arc<Comm>> = streams
        .iter()
        .flat_map(|(_, list)| list.iter().map(|p| p.comm.clone()))
        .chain(inits.iter().cloned())
        .filter(|c| !c.blocking)
        .collect();
    if nonblocking.is_empty() {
        for c in &inits {
            comm::finish_init(c);
        }
        issue_streams(streams)?;
        return Ok(SUCCESS);
    }
    for c in &nonblocking {
        c.set_async(IN_PROGRESS);
    }
    let delay = config().nonblocking_delay;
    std::thread::Builder::new()
        .name("emu-nccl-nonblocking".into())
        .spawn(move || {
            diag::boundary("non-blocking NCCL group", || {
                for c in &inits {
                    c.clique.wait_complete(c);
                }
                std::thread::sleep(delay);
                let result = issue_streams(streams);
                for c in &nonblocking {
                    c.set_async(match &result {
                        Ok(()) => SUCCESS,
                        Err(e) => e.result,
                    });
                }
            })
        })
        .map_err(|e| super::NcclError {
            result: INTERNAL_ERROR,
            message: format!("cannot start a thread: {e}"),
        })?;
    Ok(IN_PROGRESS)
}

fn issue_streams(streams: Vec<(Arc<Stream>, Vec<Posted>)>) -> NResult<()> {
    for (s, list) in streams {
        if let Some(c) = s.capture() {
            crate::capture::record(
                &c,
                &s,
                Work::NcclCaptured(Arc::new(Template { posted: list })),
            )
            .map_err(|e| super::NcclError {
                result: super::UNHANDLED_CUDA_ERROR,
                message: format!("capturing an NCCL group: {:?}", e.0),
            })?;
            continue;
        }
        let op = Arc::new(StreamOp {
            ops: list.iter().map(|p| ops::issue(p, &s)).collect(),
        });
        stream::submit(&s, Work::Nccl(op)).map_err(|e| super::NcclError {
            result: super::UNHANDLED_CUDA_ERROR,
            message: format!("launching an NCCL group on {}: {:?}", s.name(), e.0),
        })?;
    }
    Ok(())
}
