//! Spreading one pair's data over the plan's rounds.
//!
//! Both ends of a pair hold the same copies in the same order, so one function of the pair
//! and its copies gives both the same rounds. Copies whose round the unit fixed (relays) keep
//! it; the rest form one byte stream cut into up to `rounds` nearly equal chunks (at least
//! `min_bytes` each, boundaries on 4 KiB when the chunks are that large), one per round,
//! starting at a round that rotates with the pair so small pairs do not all land in round 0.

use super::config::mix;
use super::program::Copy;

/// Chunk boundaries fall on multiples of this many bytes of the pair's stream.
const CUT_ALIGN: u64 = 4096;

/// The pair's copies by round, rounds ascending; copies keep their order within a round.
pub(crate) fn spread(
    pair: (u32, u32),
    copies: Vec<(Option<u32>, Copy)>,
    rounds: u32,
    min_bytes: u64,
) -> Vec<(u32, Vec<Copy>)> {
    let mut fixed: Vec<(u32, Vec<Copy>)> = Vec::new();
    let mut free: Vec<Copy> = Vec::new();
    for (round, copy) in copies {
        match round {
            Some(r) => match fixed.iter_mut().find(|(f, _)| *f == r) {
                Some((_, list)) => list.push(copy),
                None => fixed.push((r, vec![copy])),
            },
            None => free.push(copy),
        }
    }
    let total: u64 = free.iter().map(Copy::bytes).sum();
    let rounds = u64::from(rounds.max(1));
    let chunks = (total / min_bytes.max(1)).clamp(1, rounds);
    let align = if total / chunks >= 16 * CUT_ALIGN {
        CUT_ALIGN
    } else {
        1
    };
    let first = mix([u64::from(pair.0), u64::from(pair.1)]) % rounds;
    let round_of = |c: u64| ((first + c * rounds / chunks) % rounds) as u32;
    // Boundary of chunk c: c/chunks of the stream, rounded down to CUT_ALIGN (the last one
    // is the end).
    let boundary = |c: u64| -> u64 {
        if c >= chunks {
            total
        } else {
            let at = (u128::from(total) * u128::from(c) / u128::from(chunks)) as u64;
            at / align * align
        }
    };
    let mut out = fixed;
    if total > 0 {
        let mut chunk = 0u64;
        let mut lists: Vec<Vec<Copy>> = vec![Vec::new(); chunks as usize];
        let mut at = 0u64;
        for copy in &free {
            let (start, end) = (at, at + copy.bytes());
            at = end;
            let mut pos = start;
            while pos < end {
                while boundary(chunk + 1) <= pos {
                    chunk += 1;
                }
                let cut = boundary(chunk + 1).min(end);
                if pos == start && cut == end {
                    lists[chunk as usize].push(copy.clone());
                } else {
                    lists[chunk as usize].extend(copy.slice(pos - start, cut - start));
                }
                pos = cut;
            }
        }
        for (c, list) in lists.into_iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let r = round_of(c as u64);
            match out.iter_mut().find(|(f, _)| *f == r) {
                Some((_, existing)) => existing.extend(list),
                None => out.push((r, list)),
            }
        }
    }
    out.sort_by_key(|(r, _)| *r);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Buffer, CopyDim, Loc};

    fn copy(bytes_per_row: u64, rows: u64, src_stride: u64) -> Copy {
        Copy::new(
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

    #[test]
    fn a_large_pair_is_cut_evenly_and_every_byte_stays() {
        let c = copy(3000, 4096, 5000);
        let parts = spread((1, 2), vec![(None, c.clone())], 4, 1 << 20);
        assert_eq!(parts.len(), 4);
        let sizes: Vec<u64> = parts
            .iter()
            .map(|(_, l)| l.iter().map(Copy::bytes).sum())
            .collect();
        assert_eq!(sizes.iter().sum::<u64>(), c.bytes());
        assert!(sizes
            .iter()
            .all(|&s| s.abs_diff(c.bytes() / 4) <= CUT_ALIGN));
    }

    #[test]
    fn small_pairs_stay_whole_and_fixed_rounds_are_kept() {
        let small = copy(100, 10, 100);
        let parts = spread(
            (3, 4),
            vec![(None, small.clone()), (Some(2), small.clone())],
            8,
            1 << 20,
        );
        let free_rounds: Vec<u32> = parts.iter().map(|(r, _)| *r).collect();
        assert!(free_rounds.contains(&2));
        assert_eq!(
            parts.iter().map(|(_, l)| l.len()).sum::<usize>(),
            2,
            "{parts:?}"
        );
    }

    #[test]
    fn tiny_chunks_cut_anywhere() {
        let c = copy(7, 13, 11);
        for rounds in 1..9 {
            let parts = spread((0, 1), vec![(None, c.clone())], rounds, 1);
            assert_eq!(parts.len(), rounds as usize);
            let bytes: u64 = parts.iter().flat_map(|(_, l)| l).map(Copy::bytes).sum();
            assert_eq!(bytes, c.bytes());
        }
    }
}
