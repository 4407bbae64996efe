//! NCCL operations on streams. A group's operations are issued at its outermost `ncclGroupEnd`:
//! each gets its issue number (per sender/receiver pair for point-to-point, per communicator for
//! collectives), and each stream the group uses gets one piece of work ("the NCCL kernel") that,
//! when the stream reaches it, makes that stream's operations active and waits for all of them.
//! A send and the receive with the same pair and issue number rendezvous: the bytes move when
//! both are active, bounds-checked on both sides. A collective runs when every rank's matching
//! call is active.

use super::comm::Comm;
use super::reduce;
use crate::completion::Completion;
use crate::diag;
use crate::handles::lock;
use crate::memory;
use crate::stream::{Exec, Stream};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpKind {
    Send {
        buf: u64,
        count: u64,
        dtype: i32,
        peer: i32,
    },
    Recv {
        buf: u64,
        count: u64,
        dtype: i32,
        peer: i32,
    },
    AllReduce {
        send: u64,
        recv: u64,
        count: u64,
        dtype: i32,
        op: i32,
    },
    Broadcast {
        send: u64,
        recv: u64,
        count: u64,
        dtype: i32,
        root: i32,
    },
    AllGather {
        send: u64,
        recv: u64,
        count: u64,
        dtype: i32,
    },
}

impl OpKind {
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Send { .. } => "ncclSend",
            OpKind::Recv { .. } => "ncclRecv",
            OpKind::AllReduce { .. } => "ncclAllReduce",
            OpKind::Broadcast { .. } => "ncclBroadcast",
            OpKind::AllGather { .. } => "ncclAllGather",
        }
    }

    fn dtype(&self) -> i32 {
        match *self {
            OpKind::Send { dtype, .. }
            | OpKind::Recv { dtype, .. }
            | OpKind::AllReduce { dtype, .. }
            | OpKind::Broadcast { dtype, .. }
            | OpKind::AllGather { dtype, .. } => dtype,
        }
    }

    fn count(&self) -> u64 {
        match *self {
            OpKind::Send { count, .. }
            | OpKind::Recv { count, .. }
            | OpKind::AllReduce { count, .. }
            | OpKind::Broadcast { count, .. }
            | OpKind::AllGather { count, .. } => count,
        }
    }

    /// Bytes this rank sends or receives (the per-rank element count × element size).
    pub fn bytes(&self) -> u64 {
        self.count() * reduce::size_of(self.dtype()).unwrap_or(0)
    }

    fn peer(&self) -> Option<i32> {
        match *self {
            OpKind::Send { peer, .. } | OpKind::Recv { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// What every rank's call of a collective must agree on.
    fn signature(&self) -> (u8, u64, i32, i32) {
        match *self {
            OpKind::AllReduce {
                count, dtype, op, ..
            } => (0, count, dtype, op),
            OpKind::Broadcast {
                count, dtype, root, ..
            } => (1, count, dtype, root),
            OpKind::AllGather { count, dtype, .. } => (2, count, dtype, 0),
            _ => (9, 0, 0, 0),
        }
    }
}

/// An operation posted by a thread, not yet issued.
#[derive(Clone)]
pub struct Posted {
    pub comm: Arc<Comm>,
    pub kind: OpKind,
    pub stream: usize,
}

/// An issued operation.
pub struct Op {
    pub comm: Arc<Comm>,
    pub kind: OpKind,
    /// Issue number within its pair (point-to-point) or communicator (collectives).
    pub seq: u64,
    /// Issue number across the process (reports).
    pub order: u64,
    /// Issue number on its communicator, from 0 (for injected stops).
    pub index: u64,
    pub stream: String,
    pub active: AtomicBool,
    pub done: Arc<Completion>,
}

impl Op {
    pub fn describe(&self) -> String {
        let peer = self
            .kind
            .peer()
            .map(|p| format!(", peer {p}"))
            .unwrap_or_default();
        format!(
            "{} on {}{peer}, {} bytes, #{} of its {}, issued {}, stream {}, {}",
            self.kind.name(),
            self.comm.describe(),
            self.kind.bytes(),
            self.seq,
            if self.kind.peer().is_some() {
                "pair"
            } else {
                "communicator"
            },
            self.order,
            self.stream,
            if self.active.load(Ordering::Acquire) {
                "active (its stream reached it)"
            } else {
                "not active (its stream has not reached it)"
            }
        )
    }
}

/// Sends and receives of one (sender, receiver) pair, by issue number.
#[derive(Default)]
pub struct Pair {
    sends: BTreeMap<u64, Arc<Op>>,
    recvs: BTreeMap<u64, Arc<Op>>,
}

/// The ranks' calls of one collective.
pub struct CollectiveSlot {
    parts: Vec<Option<Arc<Op>>>,
}

/// One stream's share of an issued group.
pub struct StreamOp {
    pub ops: Vec<Arc<Op>>,
}

impl StreamOp {
    pub fn run(&self, _exec: &Exec<'_>) {
        // A slow rank's group starts late (once per group, as a slow GPU or host would).
        let delay = self
            .ops
            .iter()
            .map(|op| lock(&op.comm.faults).delay)
            .max()
            .unwrap_or_default();
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        for op in &self.ops {
            activate(op);
        }
        for op in &self.ops {
            op.done.wait();
        }
    }
}

/// A group captured into a graph: re-issued at each launch.
pub struct Template {
    pub posted: Vec<Posted>,
}

static ORDER: AtomicU64 = AtomicU64::new(1);

fn next_seq(map: &std::sync::Mutex<HashMap<i32, u64>>, peer: i32) -> u64 {
    let mut m = lock(map);
    let n = m.entry(peer).or_insert(0);
    *n += 1;
    *n
}

/// Issues one posted operation: gives it its issue number and makes it matchable.
pub fn issue(p: &Posted, stream: &Stream) -> Arc<Op> {
    let comm = &p.comm;
    let seq = match p.kind {
        OpKind::Send { peer, .. } => next_seq(&comm.send_seq, peer),
        OpKind::Recv { peer, .. } => next_seq(&comm.recv_seq, peer),
        _ => {
            let mut n = lock(&comm.collective_seq);
            *n += 1;
            *n
        }
    };
    let op = Arc::new(Op {
        comm: comm.clone(),
        kind: p.kind.clone(),
        seq,
        order: ORDER.fetch_add(1, Ordering::Relaxed),
        index: comm.issued.fetch_add(1, Ordering::Relaxed),
        stream: stream.name(),
        active: AtomicBool::new(false),
        done: Arc::new(Completion::new()),
    });
    match p.kind {
        OpKind::Send { peer, .. } => {
            lock(&comm.clique.pairs)
                .entry((comm.rank, peer))
                .or_default()
                .sends
                .insert(seq, op.clone());
        }
        OpKind::Recv { peer, .. } => {
            lock(&comm.clique.pairs)
                .entry((peer, comm.rank))
                .or_default()
                .recvs
                .insert(seq, op.clone());
        }
        _ => {}
    }
    {
        let mut outstanding = lock(&comm.outstanding);
        if outstanding.len() >= 4096 && outstanding.len().is_power_of_two() {
            outstanding.retain(|c| !c.is_done());
        }
        outstanding.push(op.done.clone());
    }
    crate::completion::progress();
    crate::watchdog::pending(&op);
    op
}

/// Issues a captured group for one graph launch on `stream`.
pub fn issue_template(t: &Template, stream: &Stream) -> Arc<StreamOp> {
    Arc::new(StreamOp {
        ops: t.posted.iter().map(|p| issue(p, stream)).collect(),
    })
}

/// Whether the link between the op's rank and its peer is broken (on either side).
fn link_broken(op: &Op) -> bool {
    let Some(peer) = op.kind.peer() else {
        return false;
    };
    lock(&op.comm.faults).broken.contains(&peer)
        || op
            .comm
            .clique
            .member(peer)
            .is_some_and(|p| lock(&p.faults).broken.contains(&op.comm.rank))
}

fn activate(op: &Arc<Op>) {
    // Abandoned (revoked or aborted) before its stream reached it: nothing to match.
    if op.done.is_done() {
        return;
    }
    // A stopped rank's operation never becomes active, as if its process were gone.
    if lock(&op.comm.faults)
        .stop_after
        .is_some_and(|n| op.index >= n)
    {
        return;
    }
    if link_broken(op) {
        // NCCL: an operation that hit a network error "will usually not progress and never
        // complete"; the communicator reports the error asynchronously.
        op.comm.set_async(super::REMOTE_ERROR);
        return;
    }
    op.active.store(true, Ordering::Release);
    crate::completion::progress();
    match op.kind {
        OpKind::Send { peer, .. } | OpKind::Recv { peer, .. } => {
            let sending = matches!(op.kind, OpKind::Send { .. });
            let key = if sending {
                (op.comm.rank, peer)
            } else {
                (peer, op.comm.rank)
            };
            let matched = {
                let mut pairs = lock(&op.comm.clique.pairs);
                let pair = pairs.entry(key).or_default();
                let other = if sending {
                    pair.recvs.get(&op.seq)
                } else {
                    pair.sends.get(&op.seq)
                };
                match other {
                    Some(o) if o.active.load(Ordering::Acquire) => {
                        let s = pair.sends.remove(&op.seq);
                        let r = pair.recvs.remove(&op.seq);
                        s.zip(r)
                    }
                    _ => None,
                }
            };
            if let Some((send, recv)) = matched {
                transfer(&send, &recv);
                send.done.complete();
                recv.done.complete();
            }
        }
        _ => {
            let ready = {
                let mut slots = lock(&op.comm.clique.collectives);
                let nranks = op.comm.nranks as usize;
                let slot = slots.entry(op.seq).or_insert_with(|| CollectiveSlot {
                    parts: vec![None; nranks],
                });
                if let Some(first) = slot.parts.iter().flatten().next() {
                    if first.kind.signature() != op.kind.signature() {
                        diag::fatal(format_args!(
                            "collective mismatch: call #{} of the communicator is {} on rank {} but {} on rank {} (type, count, datatype, op/root must match)",
                            op.seq,
                            describe_collective(&first.kind),
                            first.comm.rank,
                            describe_collective(&op.kind),
                            op.comm.rank
                        ));
                    }
                }
                slot.parts[op.comm.rank as usize] = Some(op.clone());
                if slot.parts.iter().all(Option::is_some) {
                    slots
                        .remove(&op.seq)
                        .map(|s| s.parts.into_iter().flatten().collect::<Vec<_>>())
                } else {
                    None
                }
            };
            if let Some(ops) = ready {
                run_collective(&ops);
                for o in &ops {
                    o.done.complete();
                }
            }
        }
    }
}

fn describe_collective(k: &OpKind) -> String {
    let (_, count, dtype, extra) = k.signature();
    format!(
        "{}(count {count}, datatype {dtype}, op/root {extra})",
        k.name()
    )
}

fn p2p_parts(k: &OpKind) -> (u64, u64, i32) {
    match *k {
        OpKind::Send {
            buf, count, dtype, ..
        }
        | OpKind::Recv {
            buf, count, dtype, ..
        } => (buf, count, dtype),
        _ => (0, 0, 0),
    }
}

/// Translates a buffer for an operation, reporting a fault (and marking the communicator's
/// asynchronous error in return mode).
fn buffer(op: &Op, addr: u64, len: u64, write: bool, what: &str) -> Option<*mut u8> {
    match memory::translate(addr, len, Some(op.comm.device)) {
        Ok(p) => Some(p),
        Err(f) => {
            let who = format!("{} ({what} of rank {})", op.describe(), op.comm.rank);
            diag::strict(f.describe(&who, addr, len, write), ());
            op.comm.set_async(super::INVALID_ARGUMENT);
            None
        }
    }
}

fn transfer(send: &Op, recv: &Op) {
    let (sbuf, scount, sdtype) = p2p_parts(&send.kind);
    let (rbuf, rcount, rdtype) = p2p_parts(&recv.kind);
    let (sbytes, rbytes) = (send.kind.bytes(), recv.kind.bytes());
    if sbytes != rbytes {
        diag::strict(
            format!(
                "message truncated: ncclSend #{} from rank {} to rank {} sends {sbytes} bytes ({scount} elements of datatype {sdtype}) but the matching ncclRecv at rank {} from rank {} receives {rbytes} bytes ({rcount} elements of datatype {rdtype}); send {} / receive {}",
                send.seq,
                send.comm.rank,
                recv.comm.rank,
                recv.comm.rank,
                send.comm.rank,
                send.describe(),
                recv.describe()
            ),
            (),
        );
        send.comm.set_async(super::INVALID_USAGE);
        recv.comm.set_async(super::INVALID_USAGE);
        return;
    }
    if sbytes == 0 {
        return;
    }
    let (Some(src), Some(dst)) = (
        buffer(send, sbuf, sbytes, false, "sendbuff"),
        buffer(recv, rbuf, rbytes, true, "recvbuff"),
    ) else {
        return;
    };
    // Between GPUs of one process NCCL's peer-to-peer transport may read the sender's buffer
    // from the receiver's GPU and write the receiver's from the sender's (P2P/direct): each
    // buffer must be accessible from the other device, which pool memory is only once granted.
    if send.comm.device != recv.comm.device {
        let denied = memory::peer_denied(sbuf, recv.comm.device)
            .map(|why| ("sendbuff", send, why))
            .or_else(|| {
                memory::peer_denied(rbuf, send.comm.device).map(|why| ("recvbuff", recv, why))
            });
        if let Some((what, op, why)) = denied {
            diag::strict(
                format!(
                    "{} ({what} of rank {}): NCCL's peer-to-peer transport between GPUs of one process (devices {} and {}) accesses the buffer from the other GPU, but {why}",
                    op.describe(),
                    op.comm.rank,
                    send.comm.device,
                    recv.comm.device
                ),
                (),
            );
            op.comm.set_async(super::INVALID_ARGUMENT);
            return;
        }
    }
    // SAFETY: both ranges were checked inside live allocations of the ranks' devices; `copy`
    // allows a self send/receive onto the same bytes.
    unsafe { std::ptr::copy(src, dst, sbytes as usize) };
}

fn run_collective(ops: &[Arc<Op>]) {
    let mut ops: Vec<&Arc<Op>> = ops.iter().collect();
    ops.sort_by_key(|o| o.comm.rank);
    let n = ops.len() as u64;
    match ops[0].kind {
        OpKind::AllReduce {
            count, dtype, op, ..
        } => {
            let len = count * reduce::size_of(dtype).unwrap_or(0);
            if len == 0 {
                return;
            }
            let mut inputs = Vec::new();
            for o in &ops {
                let OpKind::AllReduce { send, .. } = o.kind else {
                    return;
                };
                let Some(p) = buffer(o, send, len, false, "sendbuff") else {
                    return;
                };
                // SAFETY: `len` bytes at `p` were checked readable.
                inputs.push(unsafe { std::slice::from_raw_parts(p, len as usize) }.to_vec());
            }
            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let result = reduce::reduce(dtype, op, &refs);
            for o in &ops {
                let OpKind::AllReduce { recv, .. } = o.kind else {
                    return;
                };
                if let Some(p) = buffer(o, recv, len, true, "recvbuff") {
                    // SAFETY: checked writable; `result` is `len` bytes.
                    unsafe { std::ptr::copy_nonoverlapping(result.as_ptr(), p, len as usize) };
                }
            }
        }
        OpKind::Broadcast {
            count, dtype, root, ..
        } => {
            let len = count * reduce::size_of(dtype).unwrap_or(0);
            if len == 0 {
                return;
            }
            let Some(r) = ops.iter().find(|o| o.comm.rank == root) else {
                return;
            };
            let OpKind::Broadcast { send, .. } = r.kind else {
                return;
            };
            let Some(p) = buffer(r, send, len, false, "sendbuff") else {
                return;
            };
            // SAFETY: checked readable.
            let data = unsafe { std::slice::from_raw_parts(p, len as usize) }.to_vec();
            for o in &ops {
                let OpKind::Broadcast { recv, .. } = o.kind else {
                    return;
                };
                if let Some(p) = buffer(o, recv, len, true, "recvbuff") {
                    // SAFETY: checked writable.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, len as usize) };
                }
            }
        }
        OpKind::AllGather { count, dtype, .. } => {
            let len = count * reduce::size_of(dtype).unwrap_or(0);
            if len == 0 {
                return;
            }
            let mut gathered = Vec::with_capacity((len * n) as usize);
            for o in &ops {
                let OpKind::AllGather { send, .. } = o.kind else {
                    return;
                };
                let Some(p) = buffer(o, send, len, false, "sendbuff") else {
                    return;
                };
                // SAFETY: checked readable.
                gathered.extend_from_slice(unsafe { std::slice::from_raw_parts(p, len as usize) });
            }
            for o in &ops {
                let OpKind::AllGather { recv, .. } = o.kind else {
                    return;
                };
                if let Some(p) = buffer(o, recv, len * n, true, "recvbuff") {
                    // SAFETY: checked writable for nranks × len bytes.
                    unsafe { std::ptr::copy_nonoverlapping(gathered.as_ptr(), p, gathered.len()) };
                }
            }
        }
        _ => {}
    }
}

/// Abandons a communicator's unfinished operations (ncclCommAbort, ncclCommRevoke,
/// NCCL_SHRINK_ABORT): they complete without moving data, so the streams waiting for them go
/// on; their peers' operations stay pending.
pub fn abandon(comm: &Comm) {
    let mut pairs = lock(&comm.clique.pairs);
    for pair in pairs.values_mut() {
        for map in [&mut pair.sends, &mut pair.recvs] {
            map.retain(|_, op| {
                if op.comm.handle == comm.handle {
                    op.done.complete();
                    false
                } else {
                    true
                }
            });
        }
    }
    drop(pairs);
    let mut slots = lock(&comm.clique.collectives);
    for slot in slots.values_mut() {
        if let Some(op) = slot.parts[comm.rank as usize].take() {
            op.done.complete();
        }
    }
    drop(slots);
    // Operations not matchable yet (a stopped or broken one, a collective its stream has not
    // reached) end too.
    for done in lock(&comm.outstanding).iter() {
        if !done.is_done() {
            done.complete();
        }
    }
}
