//! Sets of bytes of one buffer as strided runs ([`ByteSet`]), and whether two may share a byte
//! ([`may_overlap`]): how the planner tells which later reads meet a write (late unpacks,
//! `overlap.rs`; the round a sender's conversion is first read in, `quantize.rs`), exactly for
//! runs and rows, conservatively (within a work budget) for the rest.

use super::steps::StridedCopy;

/// One side of a copy or a message as a set of bytes of one buffer: `chunk` bytes at
/// `offset + Σ i_d · stride_d` for `0 ≤ i_d < count_d` (outermost first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ByteSet {
    pub(crate) offset: u64,
    pub(crate) chunk: u64,
    /// (count, stride) per dim, outermost first.
    pub(crate) dims: Vec<(u64, u64)>,
}

impl ByteSet {
    /// `bytes` contiguous bytes at `offset`.
    pub(crate) fn run(offset: u64, bytes: u64) -> ByteSet {
        ByteSet {
            offset,
            chunk: bytes,
            dims: Vec::new(),
        }
    }

    /// The bytes a copy reads (`src`) or writes.
    pub(crate) fn of_copy(copy: &StridedCopy, src: bool) -> ByteSet {
        ByteSet {
            offset: if src {
                copy.src.offset
            } else {
                copy.dst.offset
            },
            chunk: copy.chunk_bytes,
            dims: copy
                .dims
                .iter()
                .map(|d| (d.count, if src { d.src_stride } else { d.dst_stride }))
                .collect(),
        }
    }

    /// Bytes from the set's first byte to past its last (0 when empty).
    pub(crate) fn extent_len(&self) -> u64 {
        let (lo, hi) = self.extent();
        (hi - lo) as u64
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.chunk == 0 || self.dims.iter().any(|&(count, _)| count == 0)
    }

    /// The smallest interval holding the set (empty sets: an empty interval).
    pub(crate) fn extent(&self) -> (u128, u128) {
        let lo = u128::from(self.offset);
        if self.is_empty() {
            return (lo, lo);
        }
        let span: u128 = self
            .dims
            .iter()
            .map(|&(count, stride)| u128::from(count - 1) * u128::from(stride))
            .sum();
        (lo, lo + span + u128::from(self.chunk))
    }

    /// The sets of the outermost dim's entries (`count` of them), each without that dim.
    pub(crate) fn outer_pieces(&self) -> impl Iterator<Item = ByteSet> + '_ {
        let (count, stride) = self.dims[0];
        (0..count).map(move |i| ByteSet {
            offset: self.offset + i * stride,
            chunk: self.chunk,
            dims: self.dims[1..].to_vec(),
        })
    }
}

/// The reads of one buffer (a tensor's destination view, or the workspace) by a program's
/// steps, each keyed by its round, by where their extents start, so that a write meets only the
/// reads whose extents reach it (a rank forwarding thousands of pieces of a tensor reads it
/// thousands of times).
pub(crate) struct Reads {
    /// (extent, round position, set), by the extent's start.
    by_start: Vec<((u128, u128), usize, ByteSet)>,
    /// The largest extent end among `by_start[..=i]`.
    end_max: Vec<u128>,
}

impl Reads {
    pub(crate) fn new(list: Vec<(usize, ByteSet)>) -> Reads {
        let mut by_start: Vec<((u128, u128), usize, ByteSet)> = list
            .into_iter()
            .map(|(round, set)| (set.extent(), round, set))
            .collect();
        by_start.sort_by_key(|&((lo, hi), round, _)| (lo, hi, round));
        let end_max = by_start
            .iter()
            .scan(0u128, |max, &((_, hi), _, _)| {
                *max = (*max).max(hi);
                Some(*max)
            })
            .collect();
        Reads { by_start, end_max }
    }

    /// The reads whose extents meet `written`'s, as (key, set): those starting before it
    /// ends, back to where none reaches into it.
    fn meeting<'a>(&'a self, written: &ByteSet) -> impl Iterator<Item = (usize, &'a ByteSet)> {
        let (lo, hi) = written.extent();
        let starts_before = if lo == hi {
            0
        } else {
            self.by_start
                .partition_point(|&((start, _), _, _)| start < hi)
        };
        (0..starts_before)
            .rev()
            .take_while(move |&i| self.end_max[i] > lo)
            .map(|i| &self.by_start[i])
            .filter(move |&&((_, end), _, _)| end > lo)
            .map(|((_, _), key, set)| (*key, set))
    }

    /// Whether a read in a round after position `k` may overlap `written` (each set compared
    /// paid from `work`, as [`may_overlap`] pays for its pieces).
    pub(crate) fn later_meets(&self, k: usize, written: &ByteSet, work: &mut u64) -> bool {
        self.meeting(written)
            .filter(|&(round, _)| round > k)
            .any(|(_, set)| {
                *work = work.saturating_sub(1);
                may_overlap(set, written, work)
            })
    }

    /// The smallest key among the reads that may overlap `written` (each set compared paid
    /// from `work`), if any may.
    pub(crate) fn first_meeting(&self, written: &ByteSet, work: &mut u64) -> Option<usize> {
        let mut first: Option<usize> = None;
        for (key, set) in self.meeting(written) {
            if !matches!(first, Some(f) if f <= key) {
                *work = work.saturating_sub(1);
                if may_overlap(set, written, work) {
                    first = Some(key);
                }
            }
        }
        first
    }
}

/// Whether two byte sets of one buffer may share a byte: exact for contiguous runs and for
/// sets of one dim (rows of any stride against rows of the same stride, or against a run);
/// sets of more dims, or rows of different strides, are cut into their outermost entries, each
/// paid from `budget`; once it runs out the answer is `true` (conservative).
pub(crate) fn may_overlap(a: &ByteSet, b: &ByteSet, budget: &mut u64) -> bool {
    let (a_lo, a_hi) = a.extent();
    let (b_lo, b_hi) = b.extent();
    if a_lo == a_hi || b_lo == b_hi || a_hi <= b_lo || b_hi <= a_lo {
        return false;
    }
    // Flatten the set with more dims (or, at one dim each with different strides, the one
    // with fewer rows) into its outer entries, each piece paid from the budget.
    let mut split = |s: &ByteSet, other: &ByteSet| -> bool {
        let (count, _) = s.dims[0];
        if count > *budget {
            return true;
        }
        *budget -= count;
        s.outer_pieces()
            .any(|piece| may_overlap(&piece, other, budget))
    };
    match (a.dims.len(), b.dims.len()) {
        (0, 0) => true,
        (1, 0) => rows_meet_run(a, b_lo, b_hi),
        (0, 1) => rows_meet_run(b, a_lo, a_hi),
        (1, 1) if a.dims[0].1 == b.dims[0].1 => rows_meet_rows(a, b),
        (1, 1) => {
            if a.dims[0].0 <= b.dims[0].0 {
                split(a, b)
            } else {
                split(b, a)
            }
        }
        (m, n) if m >= n => split(a, b),
        _ => split(b, a),
    }
}

/// One-dim `rows` (count n, stride P, chunk c at o) against the run `[lo, hi)`: some row i
/// with `o + iP < hi` and `o + iP + c > lo`.
fn rows_meet_run(rows: &ByteSet, lo: u128, hi: u128) -> bool {
    let (n, p) = rows.dims[0];
    let (o, c, p) = (rows.offset as i128, rows.chunk as i128, p as i128);
    let (lo, hi) = (lo as i128, hi as i128);
    if p == 0 {
        return o < hi && o + c > lo;
    }
    // i > (lo - c - o) / P and i < (hi - o) / P.
    let first = (lo - c - o).div_euclid(p) + 1;
    let last = (hi - o - 1).div_euclid(p);
    first.max(0) <= last.min(n as i128 - 1)
}

/// Two one-dim sets of the same stride P: rows i of `a` and j of `b` meet iff
/// `-c_b < d + mP < c_a` for d = o_b − o_a and some m = j − i in `[-(n_a − 1), n_b − 1]`.
fn rows_meet_rows(a: &ByteSet, b: &ByteSet) -> bool {
    let (na, p) = a.dims[0];
    let (nb, _) = b.dims[0];
    let (ca, cb, p) = (a.chunk as i128, b.chunk as i128, p as i128);
    let d = b.offset as i128 - a.offset as i128;
    if p == 0 {
        return d < ca && d > -cb;
    }
    // mP > -cb - d and mP < ca - d.
    let m_lo = (-cb - d).div_euclid(p) + 1;
    let m_hi = (ca - d - 1).div_euclid(p);
    m_lo.max(-(na as i128 - 1)) <= m_hi.min(nb as i128 - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// [`may_overlap`] with a few thousand pieces to look at.
    fn overlaps(a: &ByteSet, b: &ByteSet) -> bool {
        may_overlap(a, b, &mut 4096)
    }

    fn bytes_of(s: &ByteSet) -> BTreeSet<u64> {
        let mut out = BTreeSet::new();
        let mut index = vec![0u64; s.dims.len()];
        if s.is_empty() {
            return out;
        }
        loop {
            let base: u64 = s.offset
                + s.dims
                    .iter()
                    .zip(&index)
                    .map(|(&(_, stride), &i)| i * stride)
                    .sum::<u64>();
            out.extend(base..base + s.chunk);
            if !crate::layout::next_index(&mut index, |d| s.dims[d].0) {
                return out;
            }
        }
    }

    fn set() -> impl Strategy<Value = ByteSet> {
        (
            0u64..64,
            0u64..9,
            prop::collection::vec((0u64..5, 0u64..24), 0..3),
        )
            .prop_map(|(offset, chunk, dims)| ByteSet {
                offset,
                chunk,
                dims,
            })
    }

    proptest! {
        /// Never says "disjoint" for sets that share a byte (the oracle enumerates bytes),
        /// and is exact where it claims to be: runs and same-stride rows.
        #[test]
        fn may_overlap_is_sound_and_exact_on_rows(a in set(), b in set()) {
            let shared = !bytes_of(&a).is_disjoint(&bytes_of(&b));
            let said = overlaps(&a, &b);
            prop_assert!(said || !shared, "{a:?} {b:?}: said disjoint, share a byte");
            // Small sets are always enumerated or computed exactly.
            prop_assert_eq!(said, shared, "{:?} {:?}", a, b);
        }
    }

    #[test]
    fn sets_of_many_dims_are_answered_within_a_budget() {
        // 1000³ chunks against the same shape shifted: enumerating would take 10^9 pieces;
        // the budget answers "may overlap" at once (sound, if not exact).
        let a = ByteSet {
            offset: 0,
            chunk: 2,
            dims: vec![(1000, 1 << 30), (1000, 1 << 20), (1000, 1 << 10)],
        };
        let b = ByteSet {
            offset: 4,
            dims: vec![(1000, (1 << 30) + 8), (1000, 1 << 20), (1000, 1 << 10)],
            ..a.clone()
        };
        assert!(overlaps(&a, &b));
    }

    #[test]
    fn column_blocks_of_one_matrix_do_not_overlap() {
        // Rows of 16 KiB; columns [0, 4 KiB) and [4 KiB, 8 KiB) of 5120 rows.
        let a = ByteSet {
            offset: 0,
            chunk: 4096,
            dims: vec![(5120, 16384)],
        };
        let b = ByteSet {
            offset: 4096,
            ..a.clone()
        };
        assert!(!overlaps(&a, &b));
        assert!(overlaps(&a, &ByteSet::run(16384 * 7 + 100, 10)));
        assert!(!overlaps(&a, &ByteSet::run(16384 * 7 + 4096, 12288)));
    }
}
