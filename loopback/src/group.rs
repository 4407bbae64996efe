//! Per-thread NCCL groups and the issue of their operations. `ncclGroupStart` deepens the
//! calling thread's group; what is posted while it is open is issued together at the outermost
//! `ncclGroupEnd` (outside a group each operation is a group of its own). A group with an
//! operation on a nonblocking communicator is issued on a helper thread and returns
//! `ncclInProgress`, as NCCL may.
//!
//! Issuing is two steps. First every operation is matched (exchange.rs), under the locks of the
//! cliques involved, so a revoke sees a group either not at all or whole. Then each
//! (communicator, stream) of the group gets its stream work (the protocol of exchange.rs):
//! every `ready` write first, then each copy with its wait and `done`, then the waits for the
//! copies of its peers. No stream waits for anything before it has written all its `ready`
//! flags, so two ranks that each posted first for some pairs of a group and second for others
//! cannot wait for each other.

use crate::comm::{self, Comm};
use crate::cuda::{driver, Stream, CAPTURE_ACTIVE, CAPTURE_NONE};
use crate::exchange::{Exchange, Kind, Posted, Role};
use crate::flags::{self, Word, RETIRED};
use crate::report::{
    fail, fatal, lock, NResult, NcclError, INTERNAL_ERROR, INVALID_USAGE, IN_PROGRESS, SUCCESS,
    UNHANDLED_CUDA_ERROR,
};
use std::cell::RefCell;
use std::sync::Arc;

#[derive(Default)]
struct Group {
    posted: Vec<Posted>,
    /// The first error of a call made inside the group (its end returns it, issuing nothing).
    error: Option<(i32, String)>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// The calling thread's group depth, where NCCL keeps it (`ncclreshard_nccl_api::group_depth`),
/// so that libncclreshard reads it here as it reads NCCL's.
pub fn depth() -> u32 {
    ncclreshard_nccl_api::group_depth()
}

/// `ncclGroupStart`.
pub fn start() {
    ncclreshard_nccl_api::enter_group();
}

/// Records an error of a call made inside the open group.
pub fn note_error(result: i32, message: &str) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if depth() > 0 && g.error.is_none() {
            g.error = Some((result, message.to_string()));
        }
    });
}

/// Posts an operation (checked by the caller): collected while a group is open, else issued.
pub fn post(op: Posted) -> NResult<i32> {
    comm::claim(&op.comm, op.kind.name());
    let open = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if depth() > 0 {
            g.posted.push(op.clone());
            true
        } else {
            false
        }
    });
    if open {
        return Ok(SUCCESS);
    }
    *lock(&op.comm.owner) = None;
    launch(vec![op])
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
    launch(group.posted)
}

/// Issues a group now, or on a helper thread when a nonblocking communicator is in it.
fn launch(posted: Vec<Posted>) -> NResult<i32> {
    ncclreshard_nccl_api::self_messages_pair_up(
        &posted,
        |p| (p.peer == p.comm.rank).then_some((p.comm.handle, p.kind == Kind::Send)),
        |p| format!("{} on {}", p.kind.name(), p.comm.describe()),
    )?;
    let mut nonblocking: Vec<Arc<Comm>> = Vec::new();
    for p in &posted {
        if !p.comm.blocking && !nonblocking.iter().any(|c| c.handle == p.comm.handle) {
            nonblocking.push(p.comm.clone());
        }
    }
    if nonblocking.is_empty() {
        issue(posted)?;
        return Ok(SUCCESS);
    }
    for c in &nonblocking {
        c.set_async(IN_PROGRESS);
    }
    std::thread::Builder::new()
        .name("loopback-group".into())
        .spawn(move || {
            crate::report::boundary("a nonblocking group", || {
                let result = issue(posted);
                if let Err(e) = &result {
                    crate::report::set_last_error(&e.message);
                }
                for c in &nonblocking {
                    c.set_async(result.as_ref().map_or_else(|e| e.result, |()| SUCCESS));
                }
            })
        })
        .map_err(|e| NcclError {
            result: INTERNAL_ERROR,
            message: format!("cannot start a thread: {e}"),
        })?;
    Ok(IN_PROGRESS)
}

/// One issued operation and its part in its exchange.
struct Issued {
    op: Posted,
    exchange: Arc<Exchange>,
    role: Role,
}

/// Matches a group's operations, then enqueues their stream work (module doc).
fn issue(posted: Vec<Posted>) -> NResult<()> {
    if posted.is_empty() {
        return Ok(());
    }
    let d = driver()?;
    let mut captured = Vec::with_capacity(posted.len());
    for p in &posted {
        let _current = d.push(p.comm.context)?;
        match d.capture_status(p.stream)? {
            CAPTURE_NONE => captured.push(false),
            CAPTURE_ACTIVE => captured.push(true),
            _ => {
                return fail(
                    UNHANDLED_CUDA_ERROR,
                    format!(
                        "{} on {}: the capture of stream {:#x} was invalidated",
                        p.kind.name(),
                        p.comm.describe(),
                        p.stream
                    ),
                )
            }
        }
    }
    let issued = match_all(posted, &captured)?;
    crate::watchdog::start();
    // Each (communicator, stream) of the group, in order of first appearance.
    let mut buckets: Vec<(Arc<Comm>, usize, Vec<&Issued>)> = Vec::new();
    for i in &issued {
        match buckets
            .iter_mut()
            .find(|(c, s, _)| c.handle == i.op.comm.handle && *s == i.op.stream)
        {
            Some((_, _, list)) => list.push(i),
            None => buckets.push((i.op.comm.clone(), i.op.stream, vec![i])),
        }
    }
    for (comm, stream, list) in &buckets {
        if let Err(e) = enqueue(comm, *stream, list) {
            // Peers were matched with these operations and would wait for them forever.
            fatal(format_args!(
                "{}: could not enqueue the group's stream work on stream {stream:#x} ({}); its peers would wait for it forever",
                comm.describe(),
                e.message
            ));
        }
    }
    Ok(())
}

/// Matches every operation of a group, all its cliques locked (in serial order), after taking
/// a flag slot for each and checking that none of its communicators was revoked.
fn match_all(posted: Vec<Posted>, captured: &[bool]) -> NResult<Vec<Issued>> {
    let mut cliques: Vec<Arc<comm::Clique>> = Vec::new();
    for p in &posted {
        if !cliques.iter().any(|c| c.serial == p.comm.clique.serial) {
            cliques.push(p.comm.clique.clone());
        }
    }
    cliques.sort_by_key(|c| c.serial);
    let mut slots = crate::exchange::Reserved::take(posted.len())?;
    let mut matchers: Vec<_> = cliques.iter().map(|c| lock(&c.matcher)).collect();
    if let Some(p) = posted.iter().find(|p| p.comm.is_revoked()) {
        return crate::report::misuse(
            INVALID_USAGE,
            format!(
                "{} on {}: the communicator was revoked before the group was issued; NCCL allows only ncclCommDestroy, ncclCommAbort and ncclCommShrink on it",
                p.kind.name(),
                p.comm.describe()
            ),
        );
    }
    let mut issued = Vec::with_capacity(posted.len());
    for (op, &captured) in posted.into_iter().zip(captured) {
        let k = cliques
            .iter()
            .position(|c| c.serial == op.comm.clique.serial)
            .expect("collected above");
        let (exchange, role) = matchers[k].issue(op.clone(), captured, &mut slots);
        if !captured {
            let mut ops = lock(&op.comm.ops);
            // Forget the completed ones whenever the list has doubled, so that a communicator
            // used for many calls keeps only what may still be pending.
            if ops.len() >= 1024 && ops.len().is_power_of_two() {
                ops.retain(|(e, first)| !e.complete_for(*first));
            }
            ops.push((exchange.clone(), role == Role::First));
        }
        issued.push(Issued { op, exchange, role });
    }
    Ok(issued)
}

/// One (communicator, stream)'s share of a group: the protocol of exchange.rs.
fn enqueue(comm: &Comm, stream: Stream, list: &[&Issued]) -> NResult<()> {
    let d = driver()?;
    let pool = flags::pool();
    let _current = d.push(comm.context)?;
    for i in list.iter().filter(|i| i.role == Role::First) {
        d.write(stream, pool.address(i.exchange.slot, Word::Ready), 1)?;
    }
    for i in list.iter().filter(|i| i.role == Role::Second) {
        let slot = i.exchange.slot;
        let (src, dst) = {
            let st = lock(&i.exchange.state);
            match i.op.kind {
                Kind::Send => (i.op.ptr, st.first.op.ptr),
                Kind::Recv => (st.first.op.ptr, i.op.ptr),
            }
        };
        d.wait_eq(stream, pool.address(slot, Word::Ready), 1)?;
        d.write(stream, pool.address(slot, Word::Ready), 0)?;
        if i.op.bytes > 0 {
            // SAFETY: both buffers were posted to NCCL for this pair, which requires them to
            // hold `bytes` bytes until both streams have passed it; the waits around the copy
            // keep both there until it is done.
            unsafe { crate::copy::launch(comm.context, stream, dst, src, i.op.bytes)? };
        }
        d.write(stream, pool.address(slot, Word::Done), 1)?;
    }
    for i in list.iter().filter(|i| i.role == Role::First) {
        let slot = i.exchange.slot;
        d.wait_eq(stream, pool.address(slot, Word::Done), 1)?;
        let last = if i.exchange.captured { 0 } else { RETIRED };
        d.write(stream, pool.address(slot, Word::Done), last)?;
    }
    Ok(())
}
