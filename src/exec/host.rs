//! The host executor: runs the programs of all ranks as threads over host memory.
//!
//! It is the executable specification of the CUDA executor: the same copies, the same message
//! order, NCCL-group semantics (each rank runs its local copies, then per round its packs,
//! posts every send and receive of the round, and unpacks once all of them are complete). Where NCCL would hang — a receive
//! with no matching send, sizes that differ, a send nobody receives, peers that planned
//! different things — this executor returns an error naming the ranks instead.

use crate::error::{Error, Result};
use crate::layout::next_index;
use crate::plan::{Buffer, Loc, Message, RankProgram, StridedCopy};
use std::collections::{HashMap, VecDeque};
use std::sync::{Barrier, Mutex};

/// One rank's memory: per tensor, its source view bytes and destination view bytes (empty
/// when the rank is not on that side). Programs address these buffers by tensor index.
#[derive(Clone, Debug, Default)]
pub struct RankBuffers {
    pub src: Vec<Vec<u8>>,
    pub dst: Vec<Vec<u8>>,
}

/// Per (sender, receiver): messages in posting order, with the round they were sent in.
type Mailboxes = Mutex<HashMap<(u32, u32), VecDeque<(u32, Vec<u8>)>>>;

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
    // Every rank walks the same list of rounds (skipping those it has no part in), meeting
    // the others at a barrier after each round's sends.
    let mut rounds: Vec<u32> = programs
        .iter()
        .flat_map(|p| p.rounds().into_iter().map(|r| r.round))
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
    /// Every round any rank takes part in, ascending.
    rounds: &'a [u32],
}

fn run_rank(program: &RankProgram, memory: &mut RankBuffers, shared: Shared<'_>) -> Result<()> {
    let rank = program.rank;
    let mut staging = Vec::new();
    // Errors (and panics) are held until the round's barrier is met, and a rank that failed
    // keeps meeting the barriers, so one bad rank can never leave the others waiting.
    let mut result = guarded(rank, || {
        let len = usize::try_from(program.staging_bytes).unwrap_or(usize::MAX);
        staging.try_reserve_exact(len).map_err(|_| {
            Error::invalid_usage(format!(
                "rank {rank}: cannot allocate {} bytes of staging",
                program.staging_bytes
            ))
        })?;
        staging.resize(len, 0);
        for copy in &program.local_copies {
            run_copy(copy, memory, &mut staging).map_err(|e| e.context(format!("rank {rank}")))?;
        }
        Ok(())
    });
    let mine = program.rounds();
    for &round in shared.rounds {
        let part = mine.iter().find(|r| r.round == round);
        // Phase 1: packs and sends of the round.
        result = result.and_then(|()| match part {
            Some(part) => guarded(rank, || {
                for copy in part.packs {
                    run_copy(copy, memory, &mut staging)
                        .map_err(|e| e.context(format!("rank {rank}")))?;
                }
                send_all(rank, round, part.sends, memory, &staging, shared)
            }),
            None => Ok(()),
        });
        shared.barrier.wait();
        // Phase 2: every send of the round is posted; receives find their message or fail.
        result = result.and_then(|()| match part {
            Some(part) => guarded(rank, || {
                receive_all(
                    rank,
                    round,
                    part.recvs,
                    memory,
                    &mut staging,
                    shared.mailboxes,
                )?;
                for copy in part.unpacks {
                    run_copy(copy, memory, &mut staging)
                        .map_err(|e| e.context(format!("rank {rank}")))?;
                }
                Ok(())
            }),
            None => Ok(()),
        });
        // Nobody posts the next round's sends before every receive of this one is matched,
        // so a rank expecting a message that was not sent fails instead of taking a later one.
        shared.barrier.wait();
    }
    result
}

fn send_all(
    rank: u32,
    round: u32,
    sends: &[Message],
    memory: &RankBuffers,
    staging: &[u8],
    shared: Shared<'_>,
) -> Result<()> {
    for send in sends {
        if shared.ranks.binary_search(&send.peer).is_err() {
            return Err(Error::invalid_usage(format!(
                "rank {rank} sends to rank {} which takes no part in the call",
                send.peer
            )));
        }
        let bytes = read(memory, staging, send.loc, send.bytes)
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
    round: u32,
    recvs: &[Message],
    memory: &mut RankBuffers,
    staging: &mut [u8],
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
                "rank {rank} expects a {}-byte message from rank {} in round {round} that never arrives",
                recv.bytes, recv.peer
            ))
        })?;
        if sent_in != round {
            return Err(Error::invalid_usage(format!(
                "rank {rank} expects a message from rank {} in round {round} but it was sent in round {sent_in}",
                recv.peer
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
        write(memory, staging, recv.loc, recv.bytes)
            .map_err(|e| e.context(format!("rank {rank}")))?
            .copy_from_slice(&message);
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

fn buffer<'a>(memory: &'a RankBuffers, staging: &'a [u8], loc: Loc) -> Option<&'a [u8]> {
    match loc.buffer {
        Buffer::Src => memory.src.get(loc.tensor as usize).map(Vec::as_slice),
        Buffer::Dst => memory.dst.get(loc.tensor as usize).map(Vec::as_slice),
        Buffer::Staging => Some(staging),
    }
}

fn read<'a>(memory: &'a RankBuffers, staging: &'a [u8], loc: Loc, bytes: u64) -> Result<&'a [u8]> {
    let buf = buffer(memory, staging, loc).unwrap_or(&[]);
    let range =
        bounds(loc, bytes, buf.len()).ok_or_else(|| out_of_bounds(loc, bytes, buf.len()))?;
    Ok(&buf[range])
}

fn write<'a>(
    memory: &'a mut RankBuffers,
    staging: &'a mut [u8],
    loc: Loc,
    bytes: u64,
) -> Result<&'a mut [u8]> {
    let buf: &mut [u8] = match loc.buffer {
        Buffer::Src => memory
            .src
            .get_mut(loc.tensor as usize)
            .map_or(&mut [], Vec::as_mut_slice),
        Buffer::Dst => memory
            .dst
            .get_mut(loc.tensor as usize)
            .map_or(&mut [], Vec::as_mut_slice),
        Buffer::Staging => staging,
    };
    let len = buf.len();
    let range = bounds(loc, bytes, len).ok_or_else(|| out_of_bounds(loc, bytes, len))?;
    Ok(&mut buf[range])
}

/// Runs one strided block copy. Source and destination are distinct buffers in every copy
/// the planner emits (source view → destination view, source → staging, staging → dest).
fn run_copy(copy: &StridedCopy, memory: &mut RankBuffers, staging: &mut [u8]) -> Result<()> {
    if copy.bytes() == 0 {
        return Ok(());
    }
    if copy.src.buffer == copy.dst.buffer {
        return Err(Error::internal("a copy reads and writes the same buffer"));
    }
    // Bounds of the whole block first, so a bad program fails before writing anything.
    let src_span = copy.src_end() - copy.src.offset;
    let dst_span = copy.dst_end() - copy.dst.offset;
    // The two sides are different buffers, so they can be borrowed at once without copying.
    let RankBuffers { src, dst } = memory;
    let (from, to): (&[u8], &mut [u8]) = match (copy.src.buffer, copy.dst.buffer) {
        (Buffer::Src, Buffer::Dst) => (
            src.get(copy.src.tensor as usize)
                .map_or(&[][..], Vec::as_slice),
            dst.get_mut(copy.dst.tensor as usize)
                .map_or(&mut [][..], Vec::as_mut_slice),
        ),
        (Buffer::Src, Buffer::Staging) => (
            src.get(copy.src.tensor as usize)
                .map_or(&[][..], Vec::as_slice),
            staging,
        ),
        // A relay packs data that arrived in an earlier round.
        (Buffer::Dst, Buffer::Staging) => (
            dst.get(copy.src.tensor as usize)
                .map_or(&[][..], Vec::as_slice),
            staging,
        ),
        (Buffer::Staging, Buffer::Dst) => (
            staging,
            dst.get_mut(copy.dst.tensor as usize)
                .map_or(&mut [][..], Vec::as_mut_slice),
        ),
        (from, to) => {
            return Err(Error::internal(format!(
                "a copy from {from:?} to {to:?} is not part of any program"
            )))
        }
    };
    let src_range = bounds(copy.src, src_span, from.len())
        .ok_or_else(|| out_of_bounds(copy.src, src_span, from.len()))?;
    let (to_len, dst_range) = (to.len(), bounds(copy.dst, dst_span, to.len()));
    let dst_range = dst_range.ok_or_else(|| out_of_bounds(copy.dst, dst_span, to_len))?;
    copy_block(copy, &from[src_range], &mut to[dst_range]);
    Ok(())
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
