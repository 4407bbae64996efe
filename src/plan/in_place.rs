//! Receiving in place: a staged receive whose unpacks would copy its bytes, in order, onto one
//! contiguous run of the rank's destination buffer lands there instead, with no unpack and no
//! staging (docs/executor.md, "Receiving in place").
//!
//! A staged message is the pair's pieces of the round in stream order, and the stream follows
//! the tensors' order; where the receiver's destination views sit back to back in that order
//! (one destination buffer, views at ascending offsets: a fused expert weight described one
//! expert slot per tensor, or a model whose parameters were placed in descriptor order), the
//! message's bytes are already the run of the buffer they end up in. Only the receiver knows
//! where its views sit, and only it changes: the sender packs and sends as before, so the
//! wire is the same and the pass runs on the rank's own program after it is formed. The views
//! it runs across are listed in [`RankProgram::dst_after`], which a call checks (a
//! per-tensor call must pass them adjacent).

use super::messages::staging_aligned;
use super::program::{RankProgram, ViewAfter};
use super::steps::{Buffer, Loc, StridedCopy};

/// Where one destination view sits in the rank's destination buffer: its first byte's offset
/// and its extent in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DstRange {
    /// Byte offset of the view's first byte.
    pub offset: u64,
    /// The view's extent (first byte to past its last).
    pub bytes: u64,
}

/// `program` (a program before late unpacks are marked) with every staged receive whose
/// unpacks copy its staged bytes, in order, onto one run of adjacent destination bytes turned
/// into a receive there: those unpacks dropped, the round's remaining staging regions packed
/// anew (in their order), the views the new receives run across listed. `dst[t]` is
/// destination view `t`'s place in the buffer (`None`: the rank has no view `t`); the views
/// must not overlap. `None` when no receive lands in place (nothing is copied then).
pub fn receive_in_place(program: &RankProgram, dst: &[Option<DstRange>]) -> Option<RankProgram> {
    if program.unpacks.is_empty() || program.has_late_unpacks() {
        return None;
    }
    // Each round's ends in the packs, sends, receives and unpacks (one round without spans).
    let ends: Vec<[usize; 4]> = if program.round_spans.is_empty() {
        vec![[
            program.packs.len(),
            program.sends.len(),
            program.recvs.len(),
            program.unpacks.len(),
        ]]
    } else {
        program
            .round_spans
            .iter()
            .map(|s| [s.packs_end, s.sends_end, s.recvs_end, s.unpacks_end])
            .collect()
    };
    let mut dropped = vec![false; program.unpacks.len()];
    let mut after: Vec<ViewAfter> = Vec::new();
    // (receive, where it lands).
    let mut landing: Vec<(usize, Loc)> = Vec::new();
    let mut start = [0usize; 4];
    for end in &ends {
        let [packs, sends, recvs, unpacks] = start;
        // The round's unpacks reading staging, by where they read.
        let mut by_src: Vec<usize> = (unpacks..end[3])
            .filter(|&i| program.unpacks[i].src.buffer == Buffer::Staging)
            .collect();
        by_src.sort_by_key(|&i| program.unpacks[i].src.offset);
        // The staging the round's packs and sends read, by start: a receive's region one of
        // them reads is not only the receive's.
        let mut read: Vec<(u64, u64)> = program.packs[packs..end[0]]
            .iter()
            .map(|c| (c.src, c.src_end()))
            .chain(
                program.sends[sends..end[1]]
                    .iter()
                    .map(|m| (m.loc, m.loc.offset.saturating_add(m.bytes))),
            )
            .filter(|(loc, _)| loc.buffer == Buffer::Staging)
            .map(|(loc, end)| (loc.offset, end))
            .collect();
        read.sort_unstable();
        let read_end = read
            .iter()
            .scan(0u64, |most, &(_, e)| {
                *most = (*most).max(e);
                Some(*most)
            })
            .collect::<Vec<u64>>();
        for r in recvs..end[2] {
            let m = program.recvs[r];
            if m.loc.buffer != Buffer::Staging || m.bytes == 0 {
                continue;
            }
            let (lo, hi) = (m.loc.offset, m.loc.offset + m.bytes);
            // Some read starting before `hi` ends after `lo`.
            let before = read.partition_point(|&(s, _)| s < hi);
            if before > 0 && read_end[before - 1] > lo {
                continue;
            }
            let first = by_src.partition_point(|&i| program.unpacks[i].src.offset < lo);
            let Some(chain) = chain(&program.unpacks, &by_src[first..], lo, hi, dst) else {
                continue;
            };
            landing.push((r, program.unpacks[chain[0]].dst));
            for w in chain.windows(2) {
                let (a, b) = (program.unpacks[w[0]].dst, program.unpacks[w[1]].dst);
                if a.tensor != b.tensor {
                    let bytes = dst[a.tensor as usize].map_or(0, |r| r.bytes);
                    after.push(ViewAfter {
                        view: a.tensor,
                        bytes,
                        next: b.tensor,
                    });
                }
            }
            for i in chain {
                dropped[i] = true;
            }
        }
        start = *end;
    }
    if landing.is_empty() {
        return None;
    }
    let mut program = program.clone();
    for (r, loc) in landing {
        program.recvs[r].loc = loc;
    }
    // Each round's staging regions still used (receives' and sends'), packed anew in their
    // order from the arena's start.
    let mut staging_end = 0u64;
    let mut start = [0usize; 4];
    for end in &ends {
        let [packs, sends, recvs, unpacks] = start;
        let mut regions: Vec<(u64, u64)> = program.recvs[recvs..end[2]]
            .iter()
            .chain(&program.sends[sends..end[1]])
            .filter(|m| m.loc.buffer == Buffer::Staging)
            .map(|m| (m.loc.offset, m.bytes))
            .collect();
        regions.sort_unstable();
        // One region sent to several peers (data packed once) is one region.
        regions.dedup();
        let mut moved: Vec<(u64, u64)> = Vec::with_capacity(regions.len());
        let mut at = 0u64;
        for &(base, bytes) in &regions {
            let new = staging_aligned(at);
            moved.push((base, new));
            at = at.max(new + bytes);
        }
        staging_end = staging_end.max(at);
        let place = |loc: &mut Loc| {
            if loc.buffer == Buffer::Staging {
                let i = moved.partition_point(|&(base, _)| base <= loc.offset);
                let (base, new) = moved[i.checked_sub(1).expect("staging inside a region")];
                loc.offset = new + (loc.offset - base);
            }
        };
        for c in &mut program.packs[packs..end[0]] {
            place(&mut c.src);
            place(&mut c.dst);
        }
        for m in program.sends[sends..end[1]]
            .iter_mut()
            .chain(&mut program.recvs[recvs..end[2]])
        {
            place(&mut m.loc);
        }
        for (c, _) in program.unpacks[unpacks..end[3]]
            .iter_mut()
            .zip(&dropped[unpacks..end[3]])
            .filter(|(_, &d)| !d)
        {
            place(&mut c.src);
        }
        start = *end;
    }
    // Drop the unpacks the receives now do, each round's ending where its kept ones end.
    let mut kept_before = Vec::with_capacity(dropped.len() + 1);
    kept_before.push(0usize);
    for &d in &dropped {
        kept_before.push(kept_before.last().copied().unwrap_or(0) + usize::from(!d));
    }
    for span in &mut program.round_spans {
        span.unpacks_end = kept_before[span.unpacks_end];
    }
    let mut i = 0;
    program.unpacks.retain(|_| {
        i += 1;
        !dropped[i - 1]
    });
    program.staging_bytes = staging_end;
    after.sort_unstable();
    after.dedup();
    program.dst_after = after;
    Some(program)
}

/// The unpacks (indices, in order) that copy staging bytes `[lo, hi)` onto one run of adjacent
/// destination bytes, if `candidates` (unpacks reading staging, by where they read, from the
/// first at or after `lo`) hold such a chain: each a contiguous copy into a destination view,
/// the first reading at `lo`, each reading where the one before ended and writing where it
/// ended, in the same view or, at a view's end, from the start of the view after it in the
/// buffer; the last ending at `hi`.
fn chain(
    unpacks: &[StridedCopy],
    candidates: &[usize],
    lo: u64,
    hi: u64,
    dst: &[Option<DstRange>],
) -> Option<Vec<usize>> {
    let range = |t: u32| dst.get(t as usize).copied().flatten();
    let mut out = Vec::new();
    let mut read = lo;
    let mut written: Option<(u32, u64)> = None;
    for &i in candidates {
        if read == hi {
            break;
        }
        let u = &unpacks[i];
        if u.src.offset != read || !u.is_contiguous() || u.dst.buffer != Buffer::Dst {
            return None;
        }
        let bytes = u.bytes();
        let view = range(u.dst.tensor)?;
        if u.dst.offset.checked_add(bytes)? > view.bytes {
            return None;
        }
        if let Some((t, end)) = written {
            let follows = if t == u.dst.tensor {
                end == u.dst.offset
            } else {
                let before = range(t)?;
                end == before.bytes
                    && u.dst.offset == 0
                    && before.offset.checked_add(before.bytes)? == view.offset
            };
            if !follows {
                return None;
            }
        }
        written = Some((u.dst.tensor, u.dst.offset + bytes));
        read += bytes;
        out.push(i);
    }
    (read == hi && !out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Message, RoundSpan};

    fn loc(buffer: Buffer, tensor: u32, offset: u64) -> Loc {
        Loc {
            buffer,
            tensor,
            offset,
        }
    }

    fn copy(src: Loc, dst: Loc, bytes: u64) -> StridedCopy {
        StridedCopy::new(src, dst, bytes, &[])
    }

    /// A round receiving 96 staged bytes from rank 1 (unpacked: view 0's bytes
    /// [first_end - 32, first_end), view 1's [0, 64)) and then 16 from rank 2 (into view 2's
    /// bytes [8, 16) and [32, 40): not one run).
    fn program(first_end: u64) -> RankProgram {
        let staging = |offset| loc(Buffer::Staging, 0, offset);
        RankProgram {
            rank: 0,
            recvs: vec![
                Message {
                    peer: 1,
                    loc: staging(0),
                    bytes: 96,
                },
                Message {
                    peer: 2,
                    loc: staging(256),
                    bytes: 16,
                },
            ],
            unpacks: vec![
                copy(staging(0), loc(Buffer::Dst, 0, first_end - 32), 32),
                copy(staging(32), loc(Buffer::Dst, 1, 0), 64),
                copy(staging(256), loc(Buffer::Dst, 2, 8), 8),
                copy(staging(264), loc(Buffer::Dst, 2, 32), 8),
            ],
            round_spans: vec![RoundSpan {
                round: 0,
                recvs_end: 2,
                unpacks_end: 4,
                ..Default::default()
            }],
            staging_bytes: 272,
            ..Default::default()
        }
    }

    fn views(at: [u64; 3]) -> Vec<Option<DstRange>> {
        at.iter()
            .map(|&offset| Some(DstRange { offset, bytes: 64 }))
            .collect()
    }

    #[test]
    fn a_receive_lands_where_its_unpacks_make_one_run_across_adjacent_views() {
        let p = receive_in_place(&program(64), &views([0, 64, 512])).expect("one lands");
        assert_eq!(
            p.recvs
                .iter()
                .filter(|m| m.loc.buffer == Buffer::Dst)
                .count(),
            1
        );
        assert_eq!(p.recvs[0].loc, loc(Buffer::Dst, 0, 32));
        assert_eq!(
            p.dst_after,
            [ViewAfter {
                view: 0,
                bytes: 64,
                next: 1
            }]
        );
        // The other receive keeps its unpacks, its staging moved to the arena's start.
        assert_eq!(p.unpacks.len(), 2);
        assert_eq!(p.recvs[1].loc, loc(Buffer::Staging, 0, 0));
        assert_eq!(p.unpacks[0].src, loc(Buffer::Staging, 0, 0));
        assert_eq!(p.unpacks[1].src, loc(Buffer::Staging, 0, 8));
        assert_eq!((p.round_spans[0].unpacks_end, p.staging_bytes), (2, 16));
    }

    #[test]
    fn no_receive_lands_across_a_gap_or_from_inside_a_view() {
        for (first_end, at) in [(64, [0, 80, 512]), (48, [0, 64, 512])] {
            let p = program(first_end);
            assert_eq!(receive_in_place(&p, &views(at)), None, "{first_end} {at:?}");
        }
        // Nor one whose staging a send of the round also reads.
        let mut p = program(64);
        p.sends.push(Message {
            peer: 3,
            loc: loc(Buffer::Staging, 0, 88),
            bytes: 16,
        });
        p.round_spans[0].sends_end = 1;
        assert_eq!(receive_in_place(&p, &views([0, 64, 512])), None);
    }
}
