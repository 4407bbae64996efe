//! The rendezvous of a send and its receive, and how they are matched.
//!
//! The n-th send from rank A to rank B meets the n-th receive at B from A (NCCL's rule), their
//! sizes equal. Whichever of the two is issued first ("first") takes a flag slot
//! (flags.rs) and waits in its clique's matcher; the other ("second") knows both buffers, so
//! its stream does the copy. On the streams (group.rs):
//!
//! ```text
//! first:   write ready = 1  ...  wait done == 1, write done = 0 (graph) or RETIRED
//! second:  wait ready == 1, write ready = 0, copy, write done = 1
//! ```
//!
//! so the copy starts only once both streams have reached the pair, and neither stream passes
//! it before the copy is over. Every wait resets what it waited for, so a captured pair runs
//! again at each replay; outside graphs the first rank's final write marks the slot free.

use crate::comm::Comm;
use crate::flags::{self, Word, RETIRED};
use crate::report::{fatal, lock, NResult};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Send,
    Recv,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Send => "ncclSend",
            Kind::Recv => "ncclRecv",
        }
    }
}

/// One rank's operation, as posted.
#[derive(Clone)]
pub struct Posted {
    pub comm: Arc<Comm>,
    pub kind: Kind,
    /// The rank's buffer (device address).
    pub ptr: u64,
    pub bytes: u64,
    pub peer: i32,
    /// The stream handle as the caller passed it.
    pub stream: usize,
}

/// One side of an exchange: an issued operation.
pub struct Side {
    pub op: Posted,
    /// Its number within its (pair, direction), from 1.
    pub seq: u64,
}

impl Side {
    fn describe(&self) -> String {
        let o = &self.op;
        format!(
            "rank {} {} of {} bytes {} rank {} (#{} of the pair, stream {:#x}, {})",
            o.comm.rank,
            o.kind.name(),
            o.bytes,
            if o.kind == Kind::Send { "to" } else { "from" },
            o.peer,
            self.seq,
            o.stream,
            o.comm.describe()
        )
    }
}

/// The role of an issued operation in its exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Issued before its peer's: writes `ready`, waits for `done`.
    First,
    /// Issued after its peer's: waits for `ready`, copies, writes `done`.
    Second,
}

pub struct State {
    pub first: Side,
    pub second: Option<Side>,
    /// Released from the host (a revoke or abort of the first rank before any match): its
    /// stream goes on, and an operation that later matches it can never complete.
    pub cancelled: bool,
    /// Matched an operation that was cancelled: nothing will ever copy; only its own rank's
    /// revoke releases it.
    pub orphan: bool,
    /// The slot was given back (the pair is over, outside graphs).
    pub retired: bool,
}

/// One rendezvous: a flag slot and the operations on it.
pub struct Exchange {
    pub slot: u32,
    /// Issued during a stream capture: it runs at each replay, and its slot is the graph's.
    pub captured: bool,
    pub state: Mutex<State>,
}

impl Exchange {
    fn new(first: Side, slot: u32, captured: bool, orphan: bool) -> Arc<Exchange> {
        let e = Arc::new(Exchange {
            slot,
            captured,
            state: Mutex::new(State {
                first,
                second: None,
                cancelled: false,
                orphan,
                retired: false,
            }),
        });
        if !captured {
            let mut live = lock(live());
            // As in the communicators' lists: the finished ones go whenever the list has doubled
            // (the watchdog, when on, sweeps every 100 ms too).
            if live.len() >= 1024 && live.len().is_power_of_two() {
                live.retain(|e| !e.complete_for(true));
            }
            live.push(e.clone());
        }
        e
    }

    /// Whether the operation on this side (first or second) has completed on its stream,
    /// giving the slot back once the whole exchange is over. Exchanges in graphs never
    /// complete here (a replay may come any time).
    pub fn complete_for(&self, first: bool) -> bool {
        if self.captured {
            return false;
        }
        let mut st = lock(&self.state);
        if st.retired {
            return true;
        }
        let pool = flags::pool();
        let done = pool.load(self.slot, Word::Done);
        if done == RETIRED {
            st.retired = true;
            pool.give(self.slot);
            crate::watchdog::progress();
            return true;
        }
        !first && done >= 1
    }

    /// Releases the first operation from the host if nothing matched it yet (a revoke or abort
    /// of its rank): its stream passes the pair without a copy. Returns whether it did.
    pub fn cancel_if_unmatched(&self) -> bool {
        let mut st = lock(&self.state);
        if st.second.is_some() || st.cancelled || st.retired {
            return false;
        }
        st.cancelled = true;
        flags::pool().store(self.slot, Word::Done, 1);
        true
    }

    /// The (context, stream) of each of its operations.
    pub fn streams(&self) -> Vec<(usize, usize)> {
        let st = lock(&self.state);
        std::iter::once(&st.first)
            .chain(st.second.as_ref())
            .map(|s| (s.op.comm.context, s.op.stream))
            .collect()
    }

    /// One line for reports: who, and which flag it waits for.
    pub fn describe(&self) -> String {
        let st = lock(&self.state);
        let pool = flags::pool();
        let (ready, done) = (
            pool.load(self.slot, Word::Ready),
            pool.load(self.slot, Word::Done),
        );
        let words = format!(
            "slot {} (ready {:#x} = {ready}, done {:#x} = {done})",
            self.slot,
            pool.address(self.slot, Word::Ready),
            pool.address(self.slot, Word::Done)
        );
        let first = st.first.describe();
        let what = match (&st.second, st.cancelled, st.orphan) {
            (_, _, true) => format!(
                "{first}: it matched an operation its peer's revoke or abort cancelled; nothing will copy it until its own communicator is revoked"
            ),
            (None, true, _) => format!("{first}: released by its communicator's revoke; waiting for its stream to pass it"),
            (None, false, _) => format!(
                "{first}: posted first; rank {} has not issued the matching {}",
                st.first.op.peer,
                if st.first.op.kind == Kind::Send { "ncclRecv" } else { "ncclSend" }
            ),
            (Some(second), _, _) => {
                let stage = match (ready, done) {
                    (_, 1) => format!("the copy is done; waiting for rank {}'s stream to pass its wait", st.first.op.comm.rank),
                    (1, _) => format!("rank {}'s stream reached it; waiting for rank {}'s stream to reach its wait and copy", st.first.op.comm.rank, second.op.comm.rank),
                    _ => format!("waiting for rank {}'s stream to reach it (or the copy is running)", st.first.op.comm.rank),
                };
                format!("{first} matched with {}: {stage}", second.describe())
            }
        };
        format!(
            "{what}; {words}{}",
            if self.captured { "; captured" } else { "" }
        )
    }
}

/// Exchanges outside graphs whose slot is not given back yet (slot recycling, the watchdog).
pub fn live() -> &'static Mutex<Vec<Arc<Exchange>>> {
    static LIVE: OnceLock<Mutex<Vec<Arc<Exchange>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Gives back the slots of every exchange that is over; returns those still pending.
pub fn sweep() -> Vec<Arc<Exchange>> {
    let mut live = lock(live());
    live.retain(|e| !e.complete_for(true));
    live.clone()
}

/// Flag slots taken for one group before it is matched (running out in the middle would leave
/// the peers already matched waiting); what the group does not use goes back when dropped.
pub struct Reserved(Vec<u32>);

impl Reserved {
    /// `n` slots, giving back those of finished exchanges first if needed.
    pub fn take(n: usize) -> NResult<Reserved> {
        let pool = flags::pool();
        let mut reserved = Reserved(Vec::with_capacity(n));
        while reserved.0.len() < n {
            if let Some(s) = pool.take() {
                reserved.0.push(s);
                continue;
            }
            let pending = sweep();
            if pool.free() == 0 {
                return crate::report::misuse(
                    crate::report::INTERNAL_ERROR,
                    format!(
                        "a group of {n} operations needs as many flag slots, but only {} of the loopback stand-in's {} were free ({} exchanges in flight, the rest held by captured graphs); raise NCCL_LOOPBACK_SLOTS",
                        reserved.0.len(),
                        pool.capacity(),
                        pending.len()
                    ),
                );
            }
        }
        Ok(reserved)
    }

    fn next(&mut self) -> u32 {
        self.0
            .pop()
            .expect("a group reserves a slot for each of its operations")
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let pool = flags::pool();
        for s in self.0.drain(..) {
            pool.give(s);
        }
    }
}

/// Sends and receives of one (sender, receiver) pair not matched yet, and how many were issued.
#[derive(Default)]
struct Channel {
    sends: u64,
    recvs: u64,
    waiting_sends: VecDeque<Arc<Exchange>>,
    waiting_recvs: VecDeque<Arc<Exchange>>,
}

/// A clique's channels.
#[derive(Default)]
pub struct Matcher {
    channels: HashMap<(i32, i32), Channel>,
}

impl Matcher {
    /// Issues `op` (its clique's matcher locked by the caller): it meets the oldest unmatched
    /// operation of the other direction on its channel, or waits for it with a slot from
    /// `slots`. `captured`: its stream is being captured.
    pub fn issue(
        &mut self,
        op: Posted,
        captured: bool,
        slots: &mut Reserved,
    ) -> (Arc<Exchange>, Role) {
        let rank = op.comm.rank;
        let key = match op.kind {
            Kind::Send => (rank, op.peer),
            Kind::Recv => (op.peer, rank),
        };
        let ch = self.channels.entry(key).or_default();
        let (seq, theirs) = match op.kind {
            Kind::Send => {
                ch.sends += 1;
                (ch.sends, ch.waiting_recvs.pop_front())
            }
            Kind::Recv => {
                ch.recvs += 1;
                (ch.recvs, ch.waiting_sends.pop_front())
            }
        };
        let kind = op.kind;
        let side = Side { op, seq };
        let Some(theirs) = theirs else {
            let e = Exchange::new(side, slots.next(), captured, false);
            let ch = self.channels.get_mut(&key).expect("entered above");
            match kind {
                Kind::Send => ch.waiting_sends.push_back(e.clone()),
                Kind::Recv => ch.waiting_recvs.push_back(e.clone()),
            }
            return (e, Role::First);
        };
        let mut st = lock(&theirs.state);
        if st.cancelled {
            drop(st);
            // NCCL would leave it waiting for a peer that abandoned it; so does the stand-in,
            // until this rank's own revoke releases it.
            return (
                Exchange::new(side, slots.next(), captured, true),
                Role::First,
            );
        }
        let first = &st.first;
        if first.op.bytes != side.op.bytes {
            let (s, r) = if side.op.kind == Kind::Send {
                (&side, first)
            } else {
                (first, &side)
            };
            fatal(format_args!(
                "message size mismatch: {} meets {}; NCCL requires equal sizes (it would truncate the message or wait for the rest forever)",
                s.describe(),
                r.describe()
            ));
        }
        if theirs.captured != captured {
            let (c, e) = if captured {
                (&side, first)
            } else {
                (first, &side)
            };
            fatal(format_args!(
                "{} was issued during a CUDA graph capture but its match {} was not: the loopback stand-in pairs captured operations only with captured ones (each replay of one graph must meet a replay of the other)",
                c.describe(),
                e.describe()
            ));
        }
        st.second = Some(side);
        drop(st);
        (theirs, Role::Second)
    }
}
