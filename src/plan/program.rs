//! `RankProgram`: the one IR between the planner and the executors (docs/design.md §4).
//!
//! Pure data. Every address is a byte offset relative to one of the rank's buffers: a tensor's
//! source view, a tensor's destination view, the rank's staging arena or its conversion
//! workspace. An executor runs each round in order: the round's conversions (the sender-side
//! conversions whose output the round is the first to read, [`RoundSpan::converts_end`]), its
//! packs (after the local copies in the first round), every send and receive of the round
//! (posted together, like one NCCL group), then the round's unpacks. A round's conversions
//! after the first round's may run beside the previous round (they write workspace regions
//! nothing reads before them) and must be done before the round's packs; the local copies may
//! run beside the first round where [`RankProgram::local_copies_beside`] says so; a round's *late*
//! unpacks ([`RoundSpan::late_unpacks`]) may run beside the next round and must be done
//! before the round after next posts its messages. Rounds bound the staging arena (it is
//! reused by every round; late unpacks read two extra arenas, one per round parity) and let a
//! rank forward in round `r + 1` what it received in round `r` (relays). Sends to a peer and receives from it are listed in the order
//! both sides post them, in the same rounds on both sides; sizes match by construction.

use super::steps::{Buffer, Loc, StridedConvert, StridedCopy};

/// One point-to-point message: `bytes` contiguous bytes at `loc`, to or from `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Message {
    /// The other end: the receiver of a send, the sender of a receive.
    pub peer: u32,
    /// Where the bytes are read from (a send) or land (a receive).
    pub loc: Loc,
    /// The message's size; equal on both ends.
    pub bytes: u64,
}

/// One round of a program: the ends (exclusive) of its packs, sends, receives and unpacks in
/// the program's lists. Rounds are listed in increasing `round`; a rank lists only the rounds it
/// takes part in, and a message's round is the same on both its ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RoundSpan {
    /// The round's number in the plan (the same on both ends of each of its messages).
    pub round: u32,
    /// End of the round's conversions in `RankProgram::converts_before`: those whose output
    /// (a tensor's converted region of the workspace, and its scales) no earlier round reads.
    /// An executor may run a later round's conversions beside the previous round; they must
    /// be done before the round's packs (docs/quantization.md, "Conversions beside transfers").
    pub converts_end: usize,
    /// End of the round's packs in `RankProgram::packs`.
    pub packs_end: usize,
    /// End of its sends in `RankProgram::sends`.
    pub sends_end: usize,
    /// End of its receives in `RankProgram::recvs`.
    pub recvs_end: usize,
    /// End of its unpacks in `RankProgram::unpacks`.
    pub unpacks_end: usize,
    /// How many of the round's unpacks (the last ones of its range) are *late*: nothing a
    /// later round sends or packs reads what they write, and what they read of the staging
    /// arena no later round's receives or packs overwrite before the round after next, so an
    /// executor may run them beside the next round's transfers (docs/architecture.md,
    /// "Overlapping unpacks"). 0: every unpack finishes before the next round starts.
    pub late_unpacks: usize,
}

/// The parts of one round (see [`RankProgram::rounds`]).
#[derive(Clone, Copy, Debug)]
pub struct Round<'a> {
    /// The round's number in the plan.
    pub round: u32,
    /// The conversions the round is the first to read (see [`RoundSpan::converts_end`]);
    /// with no spans, every one of `RankProgram::converts_before`.
    pub converts: &'a [StridedConvert],
    /// Copies into staging before the round's sends (a relay's read its destination view).
    pub packs: &'a [StridedCopy],
    /// The round's sends, grouped by peer in posting order.
    pub sends: &'a [Message],
    /// The round's receives, grouped by peer in posting order.
    pub recvs: &'a [Message],
    /// Every unpack of the round: the early ones, then [`Round::late`] late ones.
    pub unpacks: &'a [StridedCopy],
    /// How many of `unpacks` (the last ones) are late (see [`RoundSpan::late_unpacks`]).
    pub late: usize,
    /// `Some(s)`: step `s` of the senders' barrier before round `round`
    /// ([`RankProgram::barrier_step`]): an 8-byte message to and one from node mates, no
    /// data. `None`: a round of the plan.
    pub barrier: Option<u32>,
}

impl<'a> Round<'a> {
    /// The unpacks that finish before the next round starts.
    pub fn early_unpacks(&self) -> &'a [StridedCopy] {
        &self.unpacks[..self.unpacks.len() - self.late]
    }

    /// The unpacks that may run beside the next round's transfers (they must finish before
    /// the round after next starts, and before the call ends).
    pub fn late_unpacks(&self) -> &'a [StridedCopy] {
        &self.unpacks[self.unpacks.len() - self.late..]
    }
}

/// How one rank's part of a plan is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExecMode {
    /// Every receive lands in the destination buffer: callable inside a user's NCCL group.
    Groupable,
    /// Some receives land in staging and are unpacked afterwards (or converted), or the
    /// program has several rounds: not callable inside a group.
    Staged,
}

/// Everything one rank does for one reshard call. Deterministic: every rank computes its own
/// program from the same descriptors, and the sends of one rank to another equal, in order
/// and size, that rank's receives from it.
///
/// Every transport runs it by the one walk of `exec::schedule`: each round (its conversions,
/// its packs with the local copies before or beside the first round's, sends and receives,
/// unpacks), then `converts_after`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankProgram {
    /// The rank that runs it.
    pub rank: u32,
    /// Equal on all ranks iff they planned from the same descriptors and config.
    pub fingerprint: u64,
    /// Conversions of data this rank sends (or copies locally) in another dtype, from its
    /// source views into the workspace, by the round that first reads their output
    /// ([`RoundSpan::converts_end`]); with no spans, all before the one round.
    pub converts_before: Vec<StridedConvert>,
    /// Source → destination copies of data this rank holds on both sides (colocated ranks).
    pub local_copies: Vec<StridedCopy>,
    /// Source → staging copies that gather non-contiguous send data, before the sends.
    pub packs: Vec<StridedCopy>,
    /// Sends, by round, then grouped by peer in posting order.
    pub sends: Vec<Message>,
    /// Receives, by round, then grouped by peer in posting order.
    pub recvs: Vec<Message>,
    /// Staging → destination copies after the receives complete.
    pub unpacks: Vec<StridedCopy>,
    /// Where each round ends in the four lists above; empty means one round 0 holding
    /// everything.
    pub round_spans: Vec<RoundSpan>,
    /// Bytes of staging arena the program addresses (the largest round's need, plus the two
    /// arenas of late unpacks, if any).
    pub staging_bytes: u64,
    /// Conversions of data this rank received in its source dtype, from the workspace into
    /// its destination views (and their scales), after the last round.
    pub converts_after: Vec<StridedConvert>,
    /// Bytes of conversion workspace ([`Buffer::Work`](crate::plan::Buffer::Work)) the program
    /// addresses.
    pub work_bytes: u64,
    /// Destination views that sit back to back in the call's destination buffer and that a
    /// receive landing in place runs across (`plan::in_place`), by view. A receive at
    /// `Loc { Dst, t, offset }` may run past the end of view `t` into the view after it (and
    /// on); a call must keep those views adjacent. Empty unless the plan was made with the
    /// rank's destination offsets.
    pub dst_after: Vec<ViewAfter>,
    /// The senders' barrier (docs/executor.md, "The senders' barrier"): before each round
    /// `1 .. barrier_rounds` of the plan (whether or not this rank takes part in it), the rank
    /// passes a dissemination barrier among `barrier_members`: step `s` (one group of its own)
    /// sends `barrier_sends[s]` and receives `barrier_recvs[s]`, so it enters round `r` only
    /// once every member has finished its rounds before `r`. 0 (and no messages) for ranks
    /// outside it.
    pub barrier_rounds: u32,
    /// The ranks passing the barrier together, this one included, ascending.
    pub barrier_members: Vec<u32>,
    /// Per step `s` of the barrier, its send: 8 bytes from the rank's slot of the staging
    /// arena to the member `2^s` after it (cyclically, in `barrier_members`).
    pub barrier_sends: Vec<Message>,
    /// Per step `s`, its receive: 8 bytes from the member `2^s` before it into a slot of the
    /// step's own.
    pub barrier_recvs: Vec<Message>,
}

/// Destination view `next` starts where view `view`, `bytes` long (its extent), ends: a
/// receive landing in place runs from one into the other. In `ncclReshardMulti`,
/// `recvbuffs[next]` must be `recvbuffs[view] + bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ViewAfter {
    /// The view a receive runs out of.
    pub view: u32,
    /// Its extent in bytes.
    pub bytes: u64,
    /// The view it runs into.
    pub next: u32,
}

impl RankProgram {
    /// Whether every receive lands in place (no unpack, conversion after, second round or
    /// barrier).
    pub fn mode(&self) -> ExecMode {
        if self.unpacks.is_empty()
            && self.converts_after.is_empty()
            && self.round_spans.iter().all(|s| s.round == 0)
            && !self.has_barrier()
        {
            ExecMode::Groupable
        } else {
            ExecMode::Staged
        }
    }

    /// Whether the rank takes part in a senders' barrier before some round.
    pub fn has_barrier(&self) -> bool {
        self.barrier_rounds > 1 && !self.barrier_sends.is_empty()
    }

    /// Steps of one senders' barrier (each a group of its own, one after another).
    pub fn barrier_steps(&self) -> u32 {
        self.barrier_sends.len().min(self.barrier_recvs.len()) as u32
    }

    /// Step `step` of the senders' barrier before round `round` of the plan, as a round of
    /// its own: the step's two messages and nothing else ([`Round::barrier`]).
    pub fn barrier_step(&self, round: u32, step: u32) -> Round<'_> {
        let s = step as usize;
        Round {
            round,
            converts: &[],
            packs: &[],
            sends: self.barrier_sends.get(s..=s).unwrap_or(&[]),
            recvs: self.barrier_recvs.get(s..=s).unwrap_or(&[]),
            unpacks: &[],
            late: 0,
            barrier: Some(step),
        }
    }

    /// Whether some round has late unpacks ([`RoundSpan::late_unpacks`]).
    pub fn has_late_unpacks(&self) -> bool {
        self.round_spans.iter().any(|s| s.late_unpacks > 0)
    }

    /// Whether an executor may run the local copies beside the first round (from after its
    /// conversions until the second round's start, or the end): a staged program whose first
    /// round's packs and sends read no destination view (what the local copies write; a relay
    /// forwards what arrived only in the round after). Nothing else writes what they write:
    /// each destination element has one source (docs/executor.md, "Local copies beside the
    /// first round").
    pub fn local_copies_beside(&self) -> bool {
        if self.local_copies.is_empty() || self.mode() != ExecMode::Staged {
            return false;
        }
        let Some(first) = self.rounds_iter().next() else {
            return false;
        };
        first.packs.iter().all(|c| c.src.buffer != Buffer::Dst)
            && first.sends.iter().all(|m| m.loc.buffer != Buffer::Dst)
    }

    /// Whether an executor may run some of the program's work beside its transfers: late
    /// unpacks, local copies beside the first round, or conversions of a round after the
    /// rank's first.
    pub fn has_side_work(&self) -> bool {
        self.has_late_unpacks()
            || self.local_copies_beside()
            || self
                .round_spans
                .first()
                .is_some_and(|first| first.converts_end < self.converts_before.len())
    }

    /// The rounds this rank runs, in order (at least one; local copies come before them).
    /// Spans out of order or out of range (a malformed program) end the list early.
    pub fn rounds(&self) -> Vec<Round<'_>> {
        self.rounds_iter().collect()
    }

    /// [`RankProgram::rounds`] without allocating (the executors' per-call path).
    pub fn rounds_iter(&self) -> impl Iterator<Item = Round<'_>> + '_ {
        let whole = Round {
            round: 0,
            converts: &self.converts_before,
            packs: &self.packs,
            sends: &self.sends,
            recvs: &self.recvs,
            unpacks: &self.unpacks,
            late: 0,
            barrier: None,
        };
        let single = self.round_spans.is_empty().then_some(whole);
        let mut start: Option<RoundSpan> = None;
        let mut spans = self.round_spans.iter();
        let spanned = std::iter::from_fn(move || {
            let span = spans.next()?;
            let from = start.unwrap_or_default();
            if start.is_some_and(|s| span.round <= s.round) {
                return None;
            }
            let round = Round {
                round: span.round,
                converts: self
                    .converts_before
                    .get(from.converts_end..span.converts_end)?,
                packs: self.packs.get(from.packs_end..span.packs_end)?,
                sends: self.sends.get(from.sends_end..span.sends_end)?,
                recvs: self.recvs.get(from.recvs_end..span.recvs_end)?,
                unpacks: self.unpacks.get(from.unpacks_end..span.unpacks_end)?,
                late: span.late_unpacks,
                barrier: None,
            };
            if round.late > round.unpacks.len() {
                return None;
            }
            start = Some(*span);
            Some(round)
        });
        single.into_iter().chain(spanned)
    }

    /// True when the round spans cover the five lists exactly, in increasing round order.
    pub fn rounds_are_consistent(&self) -> bool {
        if self.round_spans.is_empty() {
            return true;
        }
        let rounds = self.rounds();
        let last = self.round_spans.last().expect("non-empty");
        rounds.len() == self.round_spans.len()
            && last.converts_end == self.converts_before.len()
            && last.packs_end == self.packs.len()
            && last.sends_end == self.sends.len()
            && last.recvs_end == self.recvs.len()
            && last.unpacks_end == self.unpacks.len()
    }

    // Totals saturate: one rank's traffic over 2^64 bytes is absurd but must not wrap.
    /// Bytes the rank sends, over every round.
    pub fn bytes_sent(&self) -> u64 {
        self.sends
            .iter()
            .fold(0, |acc, m| acc.saturating_add(m.bytes))
    }

    /// Bytes the rank receives, over every round.
    pub fn bytes_received(&self) -> u64 {
        self.recvs
            .iter()
            .fold(0, |acc, m| acc.saturating_add(m.bytes))
    }

    /// Bytes the rank copies from its source views to its destination views itself.
    pub fn bytes_copied_locally(&self) -> u64 {
        self.local_copies
            .iter()
            .fold(0, |acc, c| acc.saturating_add(c.bytes()))
    }

    /// Distinct ranks this rank sends to or receives from (data or barrier).
    pub fn peers(&self) -> Vec<u32> {
        let mut peers: Vec<u32> = self
            .sends
            .iter()
            .chain(&self.recvs)
            .chain(&self.barrier_sends)
            .chain(&self.barrier_recvs)
            .map(|m| m.peer)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// True when the program has nothing to do (the rank may skip the call).
    pub fn is_empty(&self) -> bool {
        self.local_copies.is_empty()
            && self.sends.is_empty()
            && self.recvs.is_empty()
            && self.converts_before.is_empty()
            && self.converts_after.is_empty()
            && self.barrier_sends.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Buffer;

    fn message(peer: u32) -> Message {
        Message {
            peer,
            loc: Loc {
                buffer: Buffer::Src,
                tensor: 0,
                offset: 0,
            },
            bytes: 1,
        }
    }

    fn span(round: u32, sends_end: usize) -> RoundSpan {
        RoundSpan {
            round,
            sends_end,
            ..Default::default()
        }
    }

    #[test]
    fn rounds_follow_the_spans_and_stop_at_malformed_ones() {
        let mut p = RankProgram {
            sends: vec![message(1), message(2), message(3)],
            ..Default::default()
        };
        assert_eq!(p.rounds().len(), 1, "no spans: one round 0 with everything");
        assert_eq!(p.rounds()[0].sends.len(), 3);
        p.round_spans = vec![span(0, 1), span(2, 3)];
        let rounds = p.rounds();
        assert_eq!(rounds.iter().map(|r| r.round).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(rounds[1].sends, &p.sends[1..]);
        assert!(p.rounds_are_consistent());
        // Out of order, past the end, or not covering everything: malformed.
        for spans in [
            vec![span(1, 1), span(1, 3)],
            vec![span(0, 1), span(1, 4)],
            vec![span(0, 2)],
        ] {
            p.round_spans = spans;
            assert!(!p.rounds_are_consistent(), "{:?}", p.round_spans);
        }
    }
}
