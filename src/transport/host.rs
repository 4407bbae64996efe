//! The host executor: runs the programs of all ranks as threads over host memory.
//!
//! It is the executable specification of the CUDA executor: the same copies, the same message
//! order, NCCL-group semantics (each rank runs its local copies, then per round its packs,
//! posts every send and receive of the round, and unpacks once all of them are complete). Where NCCL would hang — a receive
//! with no matching send, sizes that differ, a send nobody receives, peers that planned
//! different things — this executor returns an error naming the ranks instead.

use crate::error::{Error, Result};
use crate::exec::schedule::{self, Step, Steps};
use crate::layout::next_index;
use crate::plan::{
    Buffer, Loc, Message, RankProgram, Round, StridedConvert, StridedCopy, ViewAfter,
};
use crate::quant::amax;
use std::collections::{HashMap, VecDeque};
use std::sync::{Barrier, Mutex};

/// One rank's memory: per tensor, its source view bytes and destination view bytes (empty
/// when the rank is not on that side). Programs address these buffers by tensor index.
#[derive(Clone, Debug, Default)]
pub struct RankBuffers {
    /// Per tensor, the bytes of its source view (empty off the source mesh).
    pub src: Vec<Vec<u8>>,
    /// Per tensor, then per scale tensor, the bytes of its destination view.
    pub dst: Vec<Vec<u8>>,
}

/// Per (sender, receiver): messages in posting order, with the phase they were sent in.
type Mailboxes = Mutex<HashMap<(u32, u32), VecDeque<(u128, Vec<u8>)>>>;

/// Where an exchange sits in the call's order: step `s` of the senders' barrier before round
/// `r` is phase `2r · 2^32 + s`, round `r`'s messages phase `(2r + 1) · 2^32` (after it).
fn phase(round: &Round<'_>) -> u128 {
    let r = 2 * u128::from(round.round);
    match round.barrier {
        Some(step) => (r << 32) | u128::from(step),
        None => (r + 1) << 32,
    }
}

/// A phase as messages name it.
fn phase_name(phase: u128) -> String {
    let (r, step) = (phase >> 32, phase & u128::from(u32::MAX));
    if r % 2 == 1 {
        format!("round {}", r / 2)
    } else {
        format!("step {step} of the senders' barrier before round {}", r / 2)
    }
}

/// Runs `programs[i]` against `buffers[i]` for every i, all ranks concurrently. Returns the
/// first error any rank hit (the others still finish their phases, so nothing deadlocks).
pub fn execute(programs: &[RankProgram], buffers: &mut [RankBuffers]) -> Result<()> {
    if programs.len() != buffers.len() {
        return Err(Error::invalid_usage(format!(
            "{} programs but {} rank buffers",
            programs.len(),
            buffers.len()
        )));
    }
    let mut ranks: Vec<u32> = programs.iter().map(|p| p.rank).collect();
    ranks.sort_unstable();
    if let Some(p) = programs
        .iter()
        .find(|p| p.fingerprint != programs[0].fingerprint)
    {
        return Err(Error::invalid_usage(format!(
            "rank {} planned from different descriptors than rank {} (fingerprint {:#x} vs {:#x})",
            p.rank, programs[0].rank, p.fingerprint, programs[0].fingerprint
        )));
    }
    if let Some(p) = programs.iter().find(|p| !p.rounds_are_consistent()) {
        return Err(Error::invalid_usage(format!(
            "rank {}'s program is malformed: its rounds do not cover its copies and messages in order",
            p.rank
        )));
    }
    // Every rank walks the same list of phases (rounds and senders' barriers, skipping those
    // it has no part in), meeting the others at a barrier after each phase's sends.
    let mut rounds: Vec<u128> = programs
        .iter()
        .flat_map(|p| {
            let barriers = if p.has_barrier() { p.barrier_rounds } else { 1 };
            let steps = (1..barriers)
                .flat_map(|r| (0..p.barrier_steps()).map(move |s| phase(&p.barrier_step(r, s))));
            p.rounds()
                .iter()
                .map(phase)
                .chain(steps)
                .collect::<Vec<_>>()
        })
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    let mailboxes: Mailboxes = Mutex::new(HashMap::new());
    let barrier = Barrier::new(programs.len());
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = programs
            .iter()
            .zip(buffers.iter_mut())
            .map(|(program, memory)| {
                let shared = Shared {
                    mailboxes: &mailboxes,
                    barrier: &barrier,
                    ranks: &ranks,
                    rounds: &rounds,
                };
                scope.spawn(move || run_rank(program, memory, shared))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::internal("a rank thread panicked")))
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>>>()?;
    let left = mailboxes
        .into_inner()
        .map_err(|_| Error::internal("mailbox lock poisoned"))?;
    if let Some(((from, to), queue)) = left.iter().find(|(_, q)| !q.is_empty()) {
        return Err(Error::invalid_usage(format!(
            "rank {from} sent {} message(s) to rank {to} that rank {to} never received",
            queue.len()
        )));
    }
    Ok(())
}

/// What every rank thread shares.
#[derive(Clone, Copy)]
struct Shared<'a> {
    mailboxes: &'a Mailboxes,
    barrier: &'a Barrier,
    ranks: &'a [u32],
    /// Every phase ([`phase`]) any rank takes part in, ascending.
    rounds: &'a [u128],
}

/// A rank's memory during a call: the caller's views, the staging arena and the conversion
/// workspace.
struct Memory<'a> {
    views: &'a mut RankBuffers,
    staging: Vec<u8>,
    work: Vec<u8>,
}

fn allocate(rank: u32, bytes: u64, what: &str) -> Result<Vec<u8>> {
    let len = usize::try_from(bytes).unwrap_or(usize::MAX);
    let mut buffer = Vec::new();
    buffer.try_reserve_exact(len).map_err(|_| {
        Error::invalid_usage(format!(
            "rank {rank}: cannot allocate {bytes} bytes of {what}"
        ))
    })?;
    buffer.resize(len, 0);
    Ok(buffer)
}

impl Memory<'_> {
    fn buffer(&self, loc: Loc) -> &[u8] {
        match loc.buffer {
            Buffer::Src => self
                .views
                .src
                .get(loc.tensor as usize)
                .map_or(&[], Vec::as_slice),
            Buffer::Dst => self
                .views
                .dst
                .get(loc.tensor as usize)
                .map_or(&[], Vec::as_slice),
            Buffer::Staging => &self.staging,
            Buffer::Work => &self.work,
        }
    }

    fn buffer_mut(&mut self, loc: Loc) -> &mut [u8] {
        match loc.buffer {
            Buffer::Src => self
                .views
                .src
                .get_mut(loc.tensor as usize)
                .map_or(&mut [], Vec::as_mut_slice),
            Buffer::Dst => self
                .views
                .dst
                .get_mut(loc.tensor as usize)
                .map_or(&mut [], Vec::as_mut_slice),
            Buffer::Staging => &mut self.staging,
            Buffer::Work => &mut self.work,
        }
    }

    /// `bytes` bytes at `loc`, bounds-checked.
    fn read(&self, loc: Loc, bytes: u64) -> Result<&[u8]> {
        let buf = self.buffer(loc);
        let range =
            bounds(loc, bytes, buf.len()).ok_or_else(|| out_of_bounds(loc, bytes, buf.len()))?;
        Ok(&buf[range])
    }

    /// Writes `data` at `loc`; a receive landing in place may run past the end of a
    /// destination view into the views after it (`after`, [`RankProgram::dst_after`]), as it
    /// would in one buffer. Bounds-checked.
    fn receive(&mut self, loc: Loc, data: &[u8], after: &[ViewAfter]) -> Result<()> {
        // `after` is sorted by view.
        let next = |t: u32| {
            let i = after.partition_point(|a| a.view < t);
            after.get(i).filter(|a| a.view == t)
        };
        let (mut at, mut rest) = (loc, data);
        loop {
            let here = match next(at.tensor).filter(|_| at.buffer == Buffer::Dst) {
                Some(a) => (rest.len() as u64).min(a.bytes.saturating_sub(at.offset)),
                None => rest.len() as u64,
            };
            let (now, later) = rest.split_at(here as usize);
            self.write(at, here)?.copy_from_slice(now);
            rest = later;
            if rest.is_empty() {
                return Ok(());
            }
            let a = next(at.tensor).expect("a receive runs on only into a next view");
            at = Loc {
                buffer: Buffer::Dst,
                tensor: a.next,
                offset: 0,
            };
        }
    }

    fn write(&mut self, loc: Loc, bytes: u64) -> Result<&mut [u8]> {
        let buf = self.buffer_mut(loc);
        let len = buf.len();
        let range = bounds(loc, bytes, len).ok_or_else(|| out_of_bounds(loc, bytes, len))?;
        Ok(&mut buf[range])
    }

    /// Disjoint source and destination slices of a copy: a view, the staging arena or the
    /// workspace on each side, never the same buffer twice but for two disjoint spans of the
    /// staging arena, never writing a source view.
    fn pair(
        &mut self,
        from: Loc,
        from_bytes: u64,
        to: Loc,
        to_bytes: u64,
    ) -> Result<(&[u8], &mut [u8])> {
        let Memory {
            views,
            staging,
            work,
        } = self;
        let RankBuffers { src, dst } = &mut **views;
        fn view(list: &[Vec<u8>], t: u32) -> &[u8] {
            list.get(t as usize).map_or(&[], Vec::as_slice)
        }
        let (a, b): (&[u8], &mut [u8]) = match (from.buffer, to.buffer) {
            (Buffer::Src, Buffer::Dst) => (
                view(src, from.tensor),
                dst.get_mut(to.tensor as usize)
                    .map_or(&mut [][..], Vec::as_mut_slice),
            ),
            (Buffer::Src, Buffer::Staging) => (view(src, from.tensor), staging),
            (Buffer::Src, Buffer::Work) => (view(src, from.tensor), work),
            // A relay packs data that arrived in an earlier round.
            (Buffer::Dst, Buffer::Staging) => (view(dst, from.tensor), staging),
            (Buffer::Dst, Buffer::Work) => (view(dst, from.tensor), work),
            (Buffer::Staging, Buffer::Dst) => (
                staging,
                dst.get_mut(to.tensor as usize)
                    .map_or(&mut [][..], Vec::as_mut_slice),
            ),
            (Buffer::Staging, Buffer::Work) => (staging, work),
            (Buffer::Work, Buffer::Dst) => (
                work,
                dst.get_mut(to.tensor as usize)
                    .map_or(&mut [][..], Vec::as_mut_slice),
            ),
            (Buffer::Work, Buffer::Staging) => (work, staging),
            // A relay packs what arrived the round before from the arena it landed in
            // (`plan::overlap`): two disjoint spans of the staging arena.
            (Buffer::Staging, Buffer::Staging) => {
                let len = staging.len();
                let a = bounds(from, from_bytes, len)
                    .ok_or_else(|| out_of_bounds(from, from_bytes, len))?;
                let b =
                    bounds(to, to_bytes, len).ok_or_else(|| out_of_bounds(to, to_bytes, len))?;
                if a.start < b.end && b.start < a.end {
                    return Err(Error::internal(
                        "a copy within the staging arena reads what it writes",
                    ));
                }
                return Ok(if a.end <= b.start {
                    let (low, high) = staging.split_at_mut(b.start);
                    (&low[a], &mut high[..b.end - b.start])
                } else {
                    let (low, high) = staging.split_at_mut(a.start);
                    (&high[..a.end - a.start], &mut low[b])
                });
            }
            (from, to) if from == to => {
                return Err(Error::internal("a copy reads and writes the same buffer"))
            }
            (from, to) => {
                return Err(Error::internal(format!(
                    "a copy from {from:?} to {to:?} is not part of any program"
                )))
            }
        };
        let from_range = bounds(from, from_bytes, a.len())
            .ok_or_else(|| out_of_bounds(from, from_bytes, a.len()))?;
        let (len, to_range) = (b.len(), bounds(to, to_bytes, b.len()));
        let to_range = to_range.ok_or_else(|| out_of_bounds(to, to_bytes, len))?;
        Ok((&a[from_range], &mut b[to_range]))
    }
}

fn run_rank(program: &RankProgram, views: &mut RankBuffers, shared: Shared<'_>) -> Result<()> {
    let rank = program.rank;
    let mut host = HostRank {
        program,
        rounds: program.rounds(),
        memory: Memory {
            views,
            staging: Vec::new(),
            work: Vec::new(),
        },
        shared,
        met: 0,
        deferred: [None, None],
        converts: None,
        copying: false,
        result: Ok(()),
    };
    host.result = guarded(rank, || {
        host.memory.staging = allocate(rank, program.staging_bytes, "staging")?;
        host.memory.work = allocate(rank, program.work_bytes, "conversion workspace")?;
        Ok(())
    });
    // The walk's own result repeats the first failure the rank recorded, if any.
    let _ = schedule::run(program, &mut host);
    host.meet_rounds_up_to(None);
    host.result
}

/// One rank's call on the host: the walk's steps over its memory, each round's exchange
/// through the mailboxes between two barriers that every rank meets for every round any rank
/// takes part in.
///
/// Errors (and panics) are held: a rank that failed does no more work and posts no more
/// messages, but keeps meeting the barriers, so one bad rank can never leave the others
/// waiting (they fail on the messages it did not send, naming it).
struct HostRank<'a, 'v> {
    program: &'a RankProgram,
    rounds: Vec<Round<'a>>,
    memory: Memory<'v>,
    shared: Shared<'a>,
    /// How many of `shared.rounds` this rank has met the barriers of.
    met: usize,
    /// Per parity: the round whose late unpacks are forked and not yet run.
    deferred: [Option<usize>; 2],
    /// The round whose conversions are forked and not yet run.
    converts: Option<usize>,
    /// The local copies are forked and not yet run.
    copying: bool,
    /// The rank's first failure.
    result: Result<()>,
}

impl HostRank<'_, '_> {
    /// Runs `work` unless the rank already failed; records its failure.
    fn work(&mut self, work: impl FnOnce(&mut Memory<'_>) -> Result<()>) -> Result<()> {
        if self.result.is_ok() {
            let memory = &mut self.memory;
            self.result = guarded(self.program.rank, || work(memory));
        }
        self.result.clone()
    }

    /// Runs `converts`, then `copies`, on the rank's memory (see [`HostRank::work`]).
    fn local(&mut self, converts: &[StridedConvert], copies: &[&[StridedCopy]]) -> Result<()> {
        let rank = self.program.rank;
        self.work(|memory| {
            for convert in converts {
                run_convert(convert, memory).map_err(|e| e.context(format!("rank {rank}")))?;
            }
            for copy in copies.iter().copied().flatten() {
                run_copy(copy, memory).map_err(|e| e.context(format!("rank {rank}")))?;
            }
            Ok(())
        })
    }

    /// Meets both barriers of every phase before `round` (all remaining ones for `None`) that
    /// this rank takes no part in.
    fn meet_rounds_up_to(&mut self, round: Option<u128>) {
        while let Some(&r) = self.shared.rounds.get(self.met) {
            if round.is_some_and(|round| r >= round) {
                break;
            }
            self.shared.barrier.wait();
            self.shared.barrier.wait();
            self.met += 1;
        }
    }
}

impl Steps for HostRank<'_, '_> {
    fn run(&mut self, step: Step) -> Result<()> {
        let (program, rounds) = (self.program, &self.rounds);
        let (converts, copies): (&[StridedConvert], Vec<&[StridedCopy]>) = match step {
            Step::FirstConverts => (rounds[0].converts, Vec::new()),
            Step::LocalCopies => (&[], vec![&program.local_copies[..]]),
            Step::Packs(k) => (&[], vec![rounds[k].packs]),
            Step::EarlyUnpacks(k) => (&[], vec![rounds[k].early_unpacks()]),
            Step::ConvertsAfter => (&program.converts_after, Vec::new()),
        };
        self.local(converts, &copies)
    }

    /// Phase 1: the round's sends; then, once every rank has posted its sends, phase 2: the
    /// receives find their message or fail. Nobody posts the next round's sends before every
    /// receive of this one is matched, so a rank expecting a message that was not sent fails
    /// instead of taking a later one.
    fn exchange(&mut self, _: usize, round: &Round<'_>) -> Result<()> {
        let phase = phase(round);
        self.meet_rounds_up_to(Some(phase));
        let (rank, shared, after) = (self.program.rank, self.shared, &self.program.dst_after);
        let _ = self.work(|memory| send_all(rank, phase, round.sends, memory, shared));
        shared.barrier.wait();
        let _ = self
            .work(|memory| receive_all(rank, phase, round.recvs, after, memory, shared.mailboxes));
        shared.barrier.wait();
        self.met += 1;
        self.result.clone()
    }

    /// Each step of the senders' barrier is one more exchange, in a phase of its own before
    /// the round's.
    fn barrier(&mut self, round: &Round<'_>) -> Result<()> {
        self.exchange(0, round)
    }

    /// Local copies beside the first round run as late as an executor may run them, when
    /// they are joined: at the second round's start or before the conversions after the
    /// rounds, so a plan whose first round read what they write fails here, byte for byte.
    fn fork_local(&mut self) -> Result<()> {
        self.copying = true;
        Ok(())
    }

    fn join_local(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.copying) {
            return Ok(());
        }
        self.local(&[], &[&self.program.local_copies])
    }

    /// A round's conversions run as late as an executor may run them, when they are joined:
    /// just before the round's packs, so a plan whose earlier round read what they write
    /// fails here, byte for byte.
    fn fork_converts(&mut self, k: usize) -> Result<()> {
        self.converts = Some(k);
        Ok(())
    }

    fn join_converts(&mut self, k: usize) -> Result<()> {
        if self.converts.take() != Some(k) {
            return Ok(());
        }
        self.local(self.rounds[k].converts, &[])
    }

    /// Late unpacks run as late as an executor may run them, when their parity is joined:
    /// after the packs of the rank's round after next, just before that round's messages (or
    /// at the end), so a plan that let a later round touch what they read or write fails
    /// here, byte for byte.
    fn fork_late(&mut self, k: usize) -> Result<()> {
        self.deferred[k % 2] = Some(k);
        Ok(())
    }

    fn join_late(&mut self, parity: usize) -> Result<()> {
        let Some(k) = self.deferred[parity].take() else {
            return Ok(());
        };
        self.local(&[], &[self.rounds[k].late_unpacks()])
    }
}

fn send_all(
    rank: u32,
    round: u128,
    sends: &[Message],
    memory: &Memory<'_>,
    shared: Shared<'_>,
) -> Result<()> {
    for send in sends {
        if shared.ranks.binary_search(&send.peer).is_err() {
            return Err(Error::invalid_usage(format!(
                "rank {rank} sends to rank {} which takes no part in the call",
                send.peer
            )));
        }
        let bytes = memory
            .read(send.loc, send.bytes)
            .map_err(|e| e.context(format!("rank {rank}")))?
            .to_vec();
        let mut boxes = shared
            .mailboxes
            .lock()
            .map_err(|_| Error::internal("mailbox lock poisoned"))?;
        boxes
            .entry((rank, send.peer))
            .or_default()
            .push_back((round, bytes));
    }
    Ok(())
}

fn receive_all(
    rank: u32,
    round: u128,
    recvs: &[Message],
    after: &[ViewAfter],
    memory: &mut Memory<'_>,
    mailboxes: &Mailboxes,
) -> Result<()> {
    for recv in recvs {
        let message = {
            let mut boxes = mailboxes
                .lock()
                .map_err(|_| Error::internal("mailbox lock poisoned"))?;
            boxes
                .get_mut(&(recv.peer, rank))
                .and_then(VecDeque::pop_front)
        };
        let (sent_in, message) = message.ok_or_else(|| {
            Error::invalid_usage(format!(
                "rank {rank} expects a {}-byte message from rank {} in {} that never arrives",
                recv.bytes,
                recv.peer,
                phase_name(round)
            ))
        })?;
        if sent_in != round {
            return Err(Error::invalid_usage(format!(
                "rank {rank} expects a message from rank {} in {} but it was sent in {}",
                recv.peer,
                phase_name(round),
                phase_name(sent_in)
            )));
        }
        if message.len() as u64 != recv.bytes {
            return Err(Error::invalid_usage(format!(
                "rank {rank} expects {} bytes from rank {} but it sent {}",
                recv.bytes,
                recv.peer,
                message.len()
            )));
        }
        memory
            .receive(recv.loc, &message, after)
            .map_err(|e| e.context(format!("rank {rank}")))?;
    }
    Ok(())
}

/// Runs one phase of a rank, turning a panic (a malformed program) into an error.
fn guarded(rank: u32, phase: impl FnOnce() -> Result<()>) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(phase)).unwrap_or_else(|_| {
        Err(Error::internal(format!(
            "rank {rank}: the program is malformed (a copy or message is out of range)"
        )))
    })
}

fn bounds(loc: Loc, bytes: u64, len: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(loc.offset).ok()?;
    let end = start.checked_add(usize::try_from(bytes).ok()?)?;
    (end <= len).then_some(start..end)
}

fn out_of_bounds(loc: Loc, bytes: u64, len: usize) -> Error {
    Error::internal(format!(
        "{:?} buffer of tensor {} is {len} bytes but the program addresses [{}, {})",
        loc.buffer,
        loc.tensor,
        loc.offset,
        loc.offset.saturating_add(bytes)
    ))
}

/// Runs one strided block copy. Source and destination are distinct buffers in every copy
/// the planner emits (a view, the staging arena or the workspace on each side), or two
/// disjoint spans of the staging arena (a relay forwarding from the arena its data arrived in).
fn run_copy(copy: &StridedCopy, memory: &mut Memory<'_>) -> Result<()> {
    if copy.bytes() == 0 {
        return Ok(());
    }
    // Bounds of the whole block first, so a bad program fails before writing anything.
    let src_span = copy.src_end() - copy.src.offset;
    let dst_span = copy.dst_end() - copy.dst.offset;
    let (from, to) = memory.pair(copy.src, src_span, copy.dst, dst_span)?;
    copy_block(copy, from, to);
    Ok(())
}

/// Runs one conversion (see [`convert_box`]): reads the box, then writes its scales and its
/// values, all ranges checked first.
fn run_convert(convert: &StridedConvert, memory: &mut Memory<'_>) -> Result<()> {
    if convert.elements() == 0 {
        return Ok(());
    }
    let arithmetic = &convert.arithmetic;
    let src_span = convert.reach(|d| d.src_stride, u64::from(arithmetic.src.size()));
    let dst_span = convert.reach(|d| d.dst_stride, u64::from(arithmetic.dst.size()));
    let scale_span = convert.scale_reach();
    memory.write(convert.dst, dst_span)?;
    if let Some(scale) = convert.scale {
        memory.write(scale, scale_span)?;
    }
    let (values, scales) = convert_box(convert, memory.read(convert.src, src_span)?);
    if let Some(scale) = convert.scale {
        let out = memory.write(scale, scale_span)?;
        for (offset, stored) in scales {
            out[offset..offset + stored.len()].copy_from_slice(&stored);
        }
    }
    let out = memory.write(convert.dst, dst_span)?;
    let size = arithmetic.dst.size() as usize;
    for (offset, value) in values {
        out[offset..offset + size].copy_from_slice(&value[..size]);
    }
    Ok(())
}

/// What [`convert_box`] makes of a box: every element's destination bytes (the first
/// `dst.size()` of 4) and every block's stored scale, each at its byte offset from the box's
/// destination or scale location.
pub type ConvertedBox = (Vec<(usize, [u8; 4])>, Vec<(usize, Vec<u8>)>);

/// The semantics of a [`StridedConvert`] on a source slice starting at its `src`: every
/// element's destination bytes (at its offset from `dst`) and every block's stored scale (at
/// its offset from `scale`), by `crate::quant`'s arithmetic. The GPU kernel computes the same.
pub fn convert_box(convert: &StridedConvert, src: &[u8]) -> ConvertedBox {
    let arithmetic = &convert.arithmetic;
    let dims = &convert.dims;
    let src_size = arithmetic.src.size() as usize;
    let grid: Vec<u64> = dims
        .iter()
        .map(|d| d.count.div_ceil(d.block.max(1)))
        .collect();
    let mut values = Vec::with_capacity(convert.elements() as usize);
    let mut scales = Vec::new();
    if convert.elements() == 0 {
        return (values, scales);
    }
    let mut block = vec![0u64; dims.len()];
    loop {
        // The block's elements: [block·b, min((block + 1)·b, count)) along each dim.
        let lo: Vec<u64> = dims
            .iter()
            .zip(&block)
            .map(|(d, &k)| k * d.block.max(1))
            .collect();
        let extent: Vec<u64> = dims
            .iter()
            .zip(&lo)
            .map(|(d, &l)| (l + d.block.max(1)).min(d.count) - l)
            .collect();
        let mut elements: Vec<(usize, usize)> = Vec::new();
        let mut index = vec![0u64; dims.len()];
        loop {
            let (mut s, mut t) = (0u64, 0u64);
            for (k, d) in dims.iter().enumerate() {
                s += (lo[k] + index[k]) * d.src_stride;
                t += (lo[k] + index[k]) * d.dst_stride;
            }
            elements.push((s as usize, t as usize));
            if !next_index(&mut index, |k| extent[k]) {
                break;
            }
        }
        let loaded: Vec<f32> = elements
            .iter()
            .map(|&(s, _)| arithmetic.load(&src[s..s + src_size]))
            .collect();
        let divisor = match (arithmetic.scale, convert.scale) {
            (Some(encoding), Some(_)) => {
                let scale = arithmetic.block_scale(amax(loaded.iter().copied()));
                let at: u64 = dims
                    .iter()
                    .zip(&block)
                    .map(|(d, &k)| k * d.scale_stride)
                    .sum();
                scales.push((
                    at as usize,
                    scale.stored[..encoding.format.size() as usize].to_vec(),
                ));
                scale.divisor
            }
            _ => 1.0,
        };
        for (&(_, t), &x) in elements.iter().zip(&loaded) {
            let mut out = [0u8; 4];
            arithmetic.convert(x, divisor, &mut out);
            values.push((t, out));
        }
        if !next_index(&mut block, |k| grid[k]) {
            return (values, scales);
        }
    }
}

/// The semantics of a [`StridedCopy`]: `src` and `dst` start at the copy's source and destination
/// offsets (they must span `src_end() - src.offset` and `dst_end() - dst.offset` bytes).
/// The CUDA kernels implement exactly this.
pub fn copy_block(copy: &StridedCopy, src: &[u8], dst: &mut [u8]) {
    if copy.bytes() == 0 {
        return;
    }
    let chunk = copy.chunk_bytes as usize;
    let mut index = vec![0u64; copy.dims.len()];
    loop {
        let s: u64 = copy
            .dims
            .iter()
            .zip(&index)
            .map(|(d, &i)| i * d.src_stride)
            .sum();
        let d: u64 = copy
            .dims
            .iter()
            .zip(&index)
            .map(|(d, &i)| i * d.dst_stride)
            .sum();
        let (s, d) = (s as usize, d as usize);
        dst[d..d + chunk].copy_from_slice(&src[s..s + chunk]);
        if !next_index(&mut index, |d| copy.dims[d].count) {
            return;
        }
    }
}
