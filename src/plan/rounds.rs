//! Spreading one pair's data over the plan's rounds.
//!
//! Both ends of a pair hold the same blocks in the same order, so one function of the pair
//! and its blocks gives both the same rounds. Blocks whose round the unit fixed (relays) keep
//! it; the rest form one byte stream spread over the stream's rounds (all the plan's, or all
//! but a priming round 0, docs/planner.md, "The priming round"): a pair of at least as many
//! parts as rounds sends a round's share in every one; a smaller pair spreads its stream
//! evenly over a window of rounds ([`window`]) whose length and start are not rounded to
//! whole rounds, so that the windows of a rank's many pairs, their starts spread with low
//! discrepancy ([`first_step`]), sum to nearly the same bytes in every round. The chunks go
//! out in stream order by round (a window that wraps sends its first chunks in the rounds
//! from 0): a later round of a pair never sends earlier bytes of its stream, so what a sender
//! sends first comes from the start of its streams, and it can convert the rest beside its
//! first rounds (docs/quantization.md, "Conversions beside transfers").
//!
//! A window, not chunks spaced evenly over the rounds: a rank's bytes in a round are then the
//! shares of the pairs whose window covers it, and windows whose starts are spread with low
//! discrepancy cover every round about equally however the pairs' sizes and chunk counts mix.
//! Chunks spaced `rounds / chunks` apart sample the starts at a comb of offsets instead, which
//! the starts do not spread as evenly: Kimi-K2's inference ranks (`pp16,ep32 → tp16,dp16`,
//! 512 pairs of 5 or 6 chunks over 31 rounds): the rounds' busiest ingress summed over the
//! rounds was 1.061× the busiest rank's total, 1.027× with windows, and their staging fell
//! from 4.50 GB to within the 4 GiB round budget (docs/planner.md § Rounds).
//! A block cut by a chunk boundary moves in several rounds, as the pieces [`StridedCopy::slice`]
//! gives: the [`Transfer`]s that both the programs and the exported transfer list are made of.

use super::steps::StridedCopy;
use std::ops::Range;

/// Chunk boundaries fall on multiples of this many bytes of the pair's stream.
const CUT_ALIGN: u64 = 4096;

/// The part of a [`Block`](super::Block) that moves in one round — the unit of data movement
/// a transport runs, and what `ncclReshardPlanGetTransfers` exports as one
/// `ncclReshardTransfer_t` (same name, same idea: `blockOffset` is [`Transfer::offset`],
/// `round` its round, the copy fields its [`StridedCopy`]).
///
/// A strided copy of bytes `offset .. offset + copy.bytes()` of the block's copy, counted in
/// that copy's dense order (which is the row-major element order of the block's box,
/// `elem_size` bytes per element). A block no round boundary cuts is one transfer with
/// `offset` 0 and the block's own copy; a cut one is several, which need not be boxes of the
/// tensor nor hold whole elements. Blocks come from an [`Assignment`](super::Assignment)'s
/// region; transfers are what a rank's [`RankProgram`](super::RankProgram) forms its messages
/// from ([`Planner::program_from_transfers`](super::Planner::program_from_transfers)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Index of the block in the rank's block list ([`Planner::rank_blocks`](super::Planner::rank_blocks)).
    pub block: usize,
    /// The round the transfer moves in (the same on both ends of the pair); local copies: 0
    /// (unless [`Config::local_via_messages`](super::Config::local_via_messages) sends them as
    /// messages to the rank itself, spread over rounds like any pair's).
    pub round: u32,
    /// Bytes of the block's copy before this transfer, in its dense order.
    pub offset: u64,
    /// The transfer's data: the block's copy sliced to `offset .. offset + copy.bytes()`.
    pub copy: StridedCopy,
}

/// One pair's blocks by round: `blocks` lists (block index, fixed round, copy) in canonical
/// order; the stream (the blocks without a fixed round) takes rounds `0 .. rounds`. The
/// transfers come out by round, ascending, and within a round the fixed blocks first, then the
/// stream's pieces in stream order.
#[cfg(test)]
pub(crate) fn spread(
    pair: (u32, u32),
    blocks: &[(usize, Option<u32>, &StridedCopy)],
    rounds: u32,
    min_bytes: u64,
) -> Vec<Transfer> {
    let mut out = Vec::new();
    let blocks: Vec<Spread> = blocks
        .iter()
        .map(|&(block, round, copy)| (block, round, copy.src.tensor, copy))
        .collect();
    spread_into(&mut out, pair, &blocks, 0..rounds, min_bytes);
    out
}

/// A block to spread: its index, the round its unit fixed, its tensor and its copy (whose
/// tensor fields the transfers replace with that tensor).
pub(crate) type Spread<'a> = (usize, Option<u32>, u32, &'a StridedCopy);

/// [`spread`] appending to `out`, the stream taking the rounds `stream` (from 1 when the
/// plan's first round primes its forwarding, docs/planner.md, "The priming round").
pub(crate) fn spread_into(
    out: &mut Vec<Transfer>,
    pair: (u32, u32),
    blocks: &[Spread],
    stream: Range<u32>,
    min_bytes: u64,
) {
    let of_tensor = |copy: StridedCopy, tensor: u32| copy.of_tensor(tensor);
    let whole = |block: usize, round: u32, tensor: u32, copy: &StridedCopy| Transfer {
        block,
        round,
        offset: 0,
        copy: of_tensor(copy.clone(), tensor),
    };
    // Blocks whose round the unit fixed, by round (stable: canonical order within one).
    let mut fixed: Vec<Transfer> = blocks
        .iter()
        .filter_map(|&(block, round, tensor, copy)| round.map(|r| whole(block, r, tensor, copy)))
        .collect();
    fixed.sort_by_key(|t| t.round);
    let total: u64 = blocks
        .iter()
        .filter(|(_, round, _, _)| round.is_none())
        .map(|(_, _, _, c)| c.bytes())
        .sum();
    // The stream's chunks in stream order: (round, end of the chunk in the stream).
    let rounds = u64::from(stream.len().max(1) as u32);
    let mut chunks = window((pair.0, pair.1), total, rounds, min_bytes);
    chunks.iter_mut().for_each(|c| c.0 += stream.start);
    let boundary = |c: u64| chunks.get(c as usize).map_or(total, |w| w.1);
    let round_of = |c: u64| chunks[c as usize].0;
    // The stream's transfers in stream order, and how many each chunk has.
    let mut stream: Vec<Transfer> = Vec::new();
    let mut chunk_len = vec![0usize; chunks.len()];
    if total > 0 {
        let (mut chunk, mut next_cut) = (0u64, boundary(0));
        let mut at = 0u64;
        for &(block, round, tensor, copy) in blocks {
            if round.is_some() {
                continue;
            }
            let (start, end) = (at, at + copy.bytes());
            at = end;
            let mut pos = start;
            while pos < end {
                while next_cut <= pos {
                    chunk += 1;
                    next_cut = boundary(chunk);
                }
                let cut = next_cut.min(end);
                let round = round_of(chunk);
                let before = stream.len();
                if pos == start && cut == end {
                    stream.push(whole(block, round, tensor, copy));
                } else {
                    let mut offset = pos - start;
                    for piece in copy.slice(pos - start, cut - start) {
                        let bytes = piece.bytes();
                        stream.push(Transfer {
                            block,
                            round,
                            offset,
                            copy: of_tensor(piece, tensor),
                        });
                        offset += bytes;
                    }
                }
                chunk_len[chunk as usize] += stream.len() - before;
                pos = cut;
            }
        }
    }
    // Chunks have distinct rounds, rising with c.
    let mut stream = stream.into_iter();
    let mut fixed = fixed.into_iter().peekable();
    out.reserve(blocks.len());
    for (c, &len) in chunk_len.iter().enumerate() {
        let round = round_of(c as u64);
        while let Some(t) = fixed.next_if(|t| t.round <= round) {
            out.push(t);
        }
        out.extend(stream.by_ref().take(len));
    }
    out.extend(fixed);
}

/// Where windows start and how long they are: in this many steps per round.
const STEPS: u64 = 8;

/// A pair's stream of `total` bytes cut into chunks, in stream order: each chunk's round and
/// where it ends in the stream (the last at `total`).
///
/// A pair with at least `rounds` parts of `min_bytes` sends a `rounds`-th of its stream in
/// every round, in round order. A smaller one spreads it evenly over a window of
/// `q − 1.5` rounds (`q` its parts, not rounded; counted in eighths of a round), from a start
/// that [`first_step`] places anywhere in the rounds, also between round boundaries: each
/// round the window touches gets the share of the stream the window spends in it. The window
/// touches `⌈q − 0.5⌉` rounds or fewer, as many as `⌊q⌋` parts did on average, and never more
/// than one round per part plus one. Neither its length nor its start is rounded to whole
/// rounds, so the windows of a receiver's (or a sender's) many pairs sum to nearly the same
/// bytes in every round: with both rounded to whole rounds, what DeepSeek-V3's inference
/// ranks (`pp16,ep16 → tp32,dp8`, 256 trainer peers of 9 to 14 parts over 17 rounds) took in
/// per round from their trainers' streams varied by 20.7 MB (standard deviation), now by
/// 16.3 MB (docs/planner.md, "Rounds").
fn window(pair: (u32, u32), total: u64, rounds: u64, min_bytes: u64) -> Vec<(u32, u64)> {
    if total == 0 {
        return Vec::new();
    }
    let min_bytes = min_bytes.max(1);
    let parts = total / min_bytes;
    // Chunk boundaries on CUT_ALIGN when chunks are that large (the last is the end).
    let cut = |at: u128, chunks: u64, last: bool| -> u64 {
        if last {
            return total;
        }
        let at = at as u64;
        if total / chunks.max(1) >= 16 * CUT_ALIGN {
            at / CUT_ALIGN * CUT_ALIGN
        } else {
            at
        }
    };
    if parts >= rounds {
        return (0..rounds)
            .map(|r| {
                let at = u128::from(total) * u128::from(r + 1) / u128::from(rounds);
                (r as u32, cut(at, rounds, r + 1 == rounds))
            })
            .collect();
    }
    let start = first_step(pair, rounds);
    // q − 1.5 rounds in steps, at most all rounds but one (so no round is touched twice).
    let len = (u128::from(total) * u128::from(STEPS) / u128::from(min_bytes))
        .saturating_sub(u128::from(STEPS * 3 / 2))
        .min(u128::from((rounds - 1) * STEPS)) as u64;
    if len == 0 {
        return vec![((start / STEPS) as u32, total)];
    }
    // The rounds the window touches, with the steps it spends in each, ascending by round
    // (a window that wraps past the last round sends its first bytes in the rounds from 0).
    let mut touched: Vec<(u32, u64)> = (start / STEPS..=(start + len - 1) / STEPS)
        .map(|u| {
            let steps = (start + len).min((u + 1) * STEPS) - start.max(u * STEPS);
            ((u % rounds) as u32, steps)
        })
        .collect();
    touched.sort_unstable_by_key(|t| t.0);
    let chunks = touched.len() as u64;
    let mut spent = 0u64;
    touched
        .iter()
        .enumerate()
        .map(|(i, &(round, steps))| {
            spent += steps;
            let at = u128::from(total) * u128::from(spent) / u128::from(len);
            (round, cut(at, chunks, i + 1 == touched.len()))
        })
        .collect()
}

/// Where pair (sender, receiver)'s window starts, in [`STEPS`] per round: a Weyl sequence
/// over each rank number, so that the pairs of one rank start at points spread evenly (low
/// discrepancy) whether its peers are consecutive ranks or every k-th, and so do the windows
/// their chunks take.
fn first_step((from, to): (u32, u32), rounds: u64) -> u64 {
    const SENDER: u64 = 0x9e37_79b9_7f4a_7c15; // 2^64 / golden ratio
    const RECEIVER: u64 = 0x6a09_e667_f3bc_c909; // 2^64 · (sqrt 2 - 1)
    let x = u64::from(from)
        .wrapping_mul(SENDER)
        .wrapping_add(u64::from(to).wrapping_mul(RECEIVER));
    ((u128::from(x) * u128::from(rounds * STEPS)) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Buffer, CopyDim, Loc};

    fn copy(bytes_per_row: u64, rows: u64, src_stride: u64) -> StridedCopy {
        StridedCopy::new(
            Loc {
                buffer: Buffer::Src,
                tensor: 0,
                offset: 0,
            },
            Loc {
                buffer: Buffer::Dst,
                tensor: 0,
                offset: 0,
            },
            1,
            &[
                CopyDim {
                    count: rows,
                    src_stride,
                    dst_stride: bytes_per_row,
                },
                CopyDim {
                    count: bytes_per_row,
                    src_stride: 1,
                    dst_stride: 1,
                },
            ],
        )
    }

    /// (source, destination) byte address of every byte of `copy`, in its dense order.
    fn dense_addresses(copy: &StridedCopy) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut index = vec![0u64; copy.dims.len()];
        if copy.bytes() == 0 {
            return out;
        }
        loop {
            let (mut s, mut d) = (copy.src.offset, copy.dst.offset);
            for (dim, &i) in copy.dims.iter().zip(&index) {
                s += i * dim.src_stride;
                d += i * dim.dst_stride;
            }
            out.extend((0..copy.chunk_bytes).map(|b| (s + b, d + b)));
            if !crate::layout::next_index(&mut index, |k| copy.dims[k].count) {
                return out;
            }
        }
    }

    fn bytes_by_round(parts: &[Transfer]) -> Vec<(u32, u64)> {
        let mut out: Vec<(u32, u64)> = Vec::new();
        for p in parts {
            match out.last_mut() {
                Some((r, bytes)) if *r == p.round => *bytes += p.copy.bytes(),
                _ => out.push((p.round, p.copy.bytes())),
            }
        }
        out
    }

    #[test]
    fn a_large_pair_is_cut_evenly_and_every_byte_stays() {
        let c = copy(3000, 4096, 5000);
        let parts = spread((1, 2), &[(0, None, &c)], 4, 1 << 20);
        let sizes = bytes_by_round(&parts);
        assert_eq!(sizes.len(), 4, "{sizes:?}");
        assert!(sizes.windows(2).all(|w| w[0].0 < w[1].0), "rounds ascend");
        assert_eq!(sizes.iter().map(|s| s.1).sum::<u64>(), c.bytes());
        assert!(sizes
            .iter()
            .all(|&(_, s)| s.abs_diff(c.bytes() / 4) <= CUT_ALIGN));
    }

    #[test]
    fn parts_are_the_bytes_their_offsets_name() {
        // Two blocks in one stream, cut anywhere (1-byte minimum chunks): each part moves
        // exactly the bytes at its offset of its block's dense order, and the parts of a block
        // cover it once.
        let blocks = [copy(7, 13, 11), copy(5, 9, 20)];
        for rounds in 1..7 {
            let parts = spread(
                (0, 1),
                &[(4, None, &blocks[0]), (9, None, &blocks[1])],
                rounds,
                1,
            );
            for (index, block) in [(4, &blocks[0]), (9, &blocks[1])] {
                let whole = dense_addresses(block);
                let mut mine: Vec<&Transfer> = parts.iter().filter(|p| p.block == index).collect();
                mine.sort_by_key(|p| p.offset);
                let mut covered = 0;
                for p in mine {
                    assert_eq!(p.offset, covered, "rounds {rounds}: parts are consecutive");
                    let got = dense_addresses(&p.copy);
                    let at = p.offset as usize;
                    assert_eq!(
                        got,
                        whole[at..at + got.len()],
                        "rounds {rounds}, part {p:?}"
                    );
                    covered += p.copy.bytes();
                }
                assert_eq!(covered, block.bytes());
            }
        }
    }

    #[test]
    fn small_pairs_stay_whole_and_fixed_rounds_are_kept() {
        let small = copy(100, 10, 100);
        let parts = spread(
            (3, 4),
            &[(0, None, &small), (1, Some(2), &small)],
            8,
            1 << 20,
        );
        assert_eq!(parts.len(), 2, "{parts:?}");
        assert!(parts.iter().all(|p| p.offset == 0 && p.copy == small));
        assert_eq!(
            parts.iter().find(|p| p.block == 1).map(|p| p.round),
            Some(2)
        );
    }

    #[test]
    fn a_receivers_rounds_stay_even_when_pair_sizes_mix() {
        // Kimi-K2's shape: an inference rank receives from 512 trainer ranks, a quarter of
        // them (4 pipeline stages of 32) sending 5 chunks, the rest 6, over 31 rounds. Its
        // fullest round stays within 2.5 % of its mean (chunks spaced rounds / chunks apart
        // gave up to 5 %).
        let (small, large) = (copy(4 << 20, 48, 4 << 20), copy(4 << 20, 64, 4 << 20));
        let rounds = 31;
        for to in [512, 513, 600, 602, 767] {
            let mut bytes = vec![0u64; rounds as usize];
            for from in 0..512u32 {
                let c = if [0, 13, 14, 15].contains(&(from / 32)) {
                    &small
                } else {
                    &large
                };
                for t in spread((from, to), &[(0, None, c)], rounds, 38 << 20) {
                    bytes[t.round as usize] += t.copy.bytes();
                }
            }
            let mean = bytes.iter().sum::<u64>() as f64 / f64::from(rounds);
            let fullest = *bytes.iter().max().unwrap() as f64;
            assert!(fullest <= 1.025 * mean, "receiver {to}: {bytes:?}");
        }
    }

    #[test]
    fn a_window_spreads_the_stream_evenly_from_its_start_in_stream_order() {
        // A pair of q parts (q < rounds) sends its stream over a window of q − 1.5 rounds,
        // from a start anywhere in the rounds (eighths of a round): each round gets the
        // stream's share of the steps the window spends in it, whole rounds or not. The oracle
        // walks the window step by step.
        let c = copy(3000, 4096, 5000);
        let (mut wrapped, mut between) = (0, 0);
        for rounds in [3u32, 7, 16, 17] {
            for pair in [(0, 1), (5, 9), (511, 700), (124, 407)] {
                for eighths_of_parts in [20u64, 24, 29, 47, 80] {
                    let min_bytes = c.bytes() * 8 / eighths_of_parts;
                    let parts = spread(pair, &[(0, None, &c)], rounds, min_bytes);
                    // The stream goes out in round order: a later round sends later bytes,
                    // also when the window wraps past the last round (what lets a sender
                    // convert a round's data beside the round before, quantize.rs).
                    assert!(
                        parts
                            .windows(2)
                            .all(|w| (w[0].round, w[0].offset) < (w[1].round, w[1].offset)),
                        "pair {pair:?}, {rounds} rounds: {:?}",
                        parts
                            .iter()
                            .map(|p| (p.round, p.offset))
                            .collect::<Vec<_>>()
                    );
                    let q = c.bytes() as f64 / min_bytes as f64;
                    let mut expected = vec![0f64; rounds as usize];
                    if q >= f64::from(rounds) {
                        expected
                            .iter_mut()
                            .for_each(|e| *e = 1.0 / f64::from(rounds));
                    } else {
                        let start = first_step(pair, u64::from(rounds));
                        let len = ((q - 1.5) * STEPS as f64)
                            .floor()
                            .clamp(0.0, f64::from(rounds - 1) * STEPS as f64)
                            as u64;
                        if len == 0 {
                            expected[(start / STEPS) as usize] = 1.0;
                        }
                        for step in start..start + len {
                            expected[((step / STEPS) % u64::from(rounds)) as usize] +=
                                1.0 / len as f64;
                        }
                        wrapped += usize::from(start + len > u64::from(rounds) * STEPS);
                        between += usize::from(start % STEPS != 0);
                    }
                    let mut got = vec![0u64; rounds as usize];
                    for p in &parts {
                        got[p.round as usize] += p.copy.bytes();
                    }
                    for (round, (&g, &e)) in got.iter().zip(&expected).enumerate() {
                        let e = e * c.bytes() as f64;
                        assert!(
                            (g as f64 - e).abs() <= CUT_ALIGN as f64,
                            "pair {pair:?}, {rounds} rounds, q {q}: round {round} {g} bytes, \
                             expected {e}"
                        );
                    }
                    // At most one round per part plus one.
                    let touched = got.iter().filter(|&&g| g > 0).count() as f64;
                    assert!(touched <= q.floor() + 1.0, "{touched} rounds for q {q}");
                }
            }
        }
        assert!(wrapped > 0, "some window wraps past the last round");
        assert!(between > 0, "some window starts between round boundaries");
    }

    #[test]
    fn a_stream_after_a_priming_round_leaves_round_0_to_fixed_blocks() {
        // With a priming round the stream takes rounds 1 .. R: large pairs a share in each,
        // small ones a window among them; blocks fixed to round 0 keep it.
        let (large, small) = (copy(3000, 4096, 5000), copy(3000, 100, 3000));
        for rounds in [3u32, 8, 18] {
            for pair in [(0, 1), (5, 9), (124, 407)] {
                let blocks: Vec<Spread> = vec![
                    (0, Some(0), 0, &small),
                    (1, None, 0, &large),
                    (2, None, 0, &small),
                ];
                let mut out = Vec::new();
                spread_into(&mut out, pair, &blocks, 1..rounds, large.bytes() / 3);
                let by_round = bytes_by_round(&out);
                assert_eq!(
                    by_round[0],
                    (0, small.bytes()),
                    "{rounds} rounds: {by_round:?}"
                );
                assert!(by_round[1..].iter().all(|&(r, _)| (1..rounds).contains(&r)));
                let stream: u64 = by_round[1..].iter().map(|b| b.1).sum();
                assert_eq!(stream, large.bytes() + small.bytes());
                // Every stream round from 1 takes a share when the pair has the parts.
                let mut whole = Vec::new();
                spread_into(&mut whole, pair, &blocks[1..2], 1..rounds, 1);
                assert_eq!(bytes_by_round(&whole).len(), rounds as usize - 1);
            }
        }
    }

    #[test]
    fn tiny_chunks_cut_anywhere() {
        let c = copy(7, 13, 11);
        for rounds in 1..9 {
            let parts = spread((0, 1), &[(0, None, &c)], rounds, 1);
            assert_eq!(bytes_by_round(&parts).len(), rounds as usize);
            let bytes: u64 = parts.iter().map(|p| p.copy.bytes()).sum();
            assert_eq!(bytes, c.bytes());
        }
    }
}
