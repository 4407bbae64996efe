//! Sorted sets of indices along one tensor dimension, stored as runs.
//!
//! Every index set a layout produces (a rank's indices along a dim, an overlap, a part of an
//! overlap) is strictly increasing — torch's chunking only ever selects contiguous position
//! ranges of an increasing list, and `_StridedShard` concatenates pieces in increasing order —
//! so a set is a list of disjoint, non-adjacent half-open runs plus the position of each run's
//! first element. Nothing here allocates per element.

/// A half-open run `[start, end)` of global indices whose first element sits at local
/// position `pos` of the set it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    /// The first global index of the run.
    pub start: u64,
    /// One past the last global index.
    pub end: u64,
    /// The local position of `start`: how many indices of the set come before the run.
    pub pos: u64,
}

impl Run {
    /// The number of indices in the run.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Whether the run holds no index (never true of a run of an [`IndexRuns`]).
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// A strictly increasing set of indices along one dimension.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct IndexRuns {
    runs: Runs,
    len: u64,
}

/// The runs of a set, the common case of at most one without an allocation (a planner at
/// thousands of ranks makes millions of sets, nearly all single runs). One representation per
/// list (never `Many` of fewer than two), so the derived equality and hash are the list's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
enum Runs {
    #[default]
    None,
    One(Run),
    Many(Vec<Run>),
}

impl Runs {
    fn as_slice(&self) -> &[Run] {
        match self {
            Runs::None => &[],
            Runs::One(run) => std::slice::from_ref(run),
            Runs::Many(runs) => runs,
        }
    }

    fn last_mut(&mut self) -> Option<&mut Run> {
        match self {
            Runs::None => None,
            Runs::One(run) => Some(run),
            Runs::Many(runs) => runs.last_mut(),
        }
    }

    fn push(&mut self, run: Run) {
        *self = match std::mem::take(self) {
            Runs::None => Runs::One(run),
            Runs::One(first) => Runs::Many(vec![first, run]),
            Runs::Many(mut runs) => {
                runs.push(run);
                Runs::Many(runs)
            }
        };
    }
}

impl std::ops::Deref for Runs {
    type Target = [Run];

    fn deref(&self) -> &[Run] {
        self.as_slice()
    }
}

/// torch.chunk's rule for part `c` of `parts` over a list of `len` elements: parts have
/// `ceil(len / parts)` elements, the remainder is short and trailing parts are empty
/// (5 over 4 → 2, 2, 1, 0). Returns the half-open position range.
pub fn chunk_bounds(len: u64, parts: u64, c: u64) -> (u64, u64) {
    debug_assert!(parts > 0 && c < parts);
    let chunk = len / parts + u64::from(len % parts != 0);
    // c * chunk <= len + parts, and both are bounded by u64 ranges checked at validation, but
    // saturate anyway so a bad call can only produce an empty part.
    let start = c.saturating_mul(chunk).min(len);
    let end = c.saturating_add(1).saturating_mul(chunk).min(len);
    (start, end)
}

impl IndexRuns {
    /// The empty set.
    pub fn empty() -> Self {
        IndexRuns::default()
    }

    /// `[0, n)`.
    pub fn full(n: u64) -> Self {
        IndexRuns::range(0, n)
    }

    /// `[start, end)`.
    pub fn range(start: u64, end: u64) -> Self {
        let mut runs = IndexRuns::empty();
        runs.push(start, end);
        runs
    }

    /// Builds a set from increasing, disjoint runs; adjacent runs are merged and empty ones
    /// dropped.
    pub fn from_ranges(ranges: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut runs = IndexRuns::empty();
        for (start, end) in ranges {
            runs.push(start, end);
        }
        runs
    }

    /// Appends `[start, end)`; it must lie after every index already present.
    fn push(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        if let Some(last) = self.runs.last_mut() {
            debug_assert!(start >= last.end, "runs must be pushed in increasing order");
            if last.end == start {
                last.end = end;
                self.len += end - start;
                return;
            }
        }
        self.runs.push(Run {
            start,
            end,
            pos: self.len,
        });
        self.len += end - start;
    }

    /// The number of indices in the set: a rank's local extent along the dim.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the set holds no index.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs in increasing order: non-empty, disjoint and non-adjacent, so a set has one
    /// representation.
    pub fn runs(&self) -> &[Run] {
        self.runs.as_slice()
    }

    /// The smallest index, if any.
    pub fn first(&self) -> Option<u64> {
        self.runs.first().map(|r| r.start)
    }

    /// True when the set is one contiguous range of indices.
    pub fn is_contiguous(&self) -> bool {
        self.runs.len() <= 1
    }

    /// Index of the run holding local position `pos` (`pos < len`).
    fn run_at_position(&self, pos: u64) -> usize {
        self.runs.partition_point(|r| r.pos + r.len() <= pos)
    }

    /// The global index at local position `pos`.
    pub fn index_at(&self, pos: u64) -> Option<u64> {
        if pos >= self.len {
            return None;
        }
        let run = &self.runs[self.run_at_position(pos)];
        Some(run.start + (pos - run.pos))
    }

    /// The local position of global index `index`, if the set holds it.
    pub fn position_of(&self, index: u64) -> Option<u64> {
        let i = self.runs.partition_point(|r| r.end <= index);
        let run = self.runs.get(i)?;
        (index >= run.start).then(|| run.pos + (index - run.start))
    }

    /// The elements at local positions `[start, end)` (clamped to the set), as a new set.
    pub fn slice_positions(&self, start: u64, end: u64) -> IndexRuns {
        let end = end.min(self.len);
        let mut out = IndexRuns::empty();
        if start >= end {
            return out;
        }
        for run in &self.runs[self.run_at_position(start)..] {
            if run.pos >= end {
                break;
            }
            let from = run.start + start.saturating_sub(run.pos);
            let to = run.start + (end - run.pos).min(run.len());
            out.push(from, to);
        }
        out
    }

    /// Torch's `Shard` on this list: part `coord` of `parts` by [`chunk_bounds`].
    pub fn shard(&self, parts: u64, coord: u64) -> IndexRuns {
        let (start, end) = chunk_bounds(self.len, parts, coord);
        self.slice_positions(start, end)
    }

    /// [`Placement::ShardBlocks`](super::Placement::ShardBlocks) on this list: positions
    /// `[coord·block, (coord+1)·block)`, clipped to the list.
    pub fn shard_blocks(&self, coord: u64, block: u64) -> IndexRuns {
        let start = coord.saturating_mul(block).min(self.len);
        let end = coord.saturating_add(1).saturating_mul(block).min(self.len);
        self.slice_positions(start, end)
    }

    /// Torch's `_StridedShard(split_factor)` on this list: chunk into `split_factor` pieces,
    /// chunk each piece into `parts`, and take part `coord` of every piece, in piece order.
    pub fn strided_shard(&self, parts: u64, coord: u64, split_factor: u64) -> IndexRuns {
        let mut out = IndexRuns::empty();
        // Pieces past `len` are empty (chunk size 1), so at most `len` pieces hold anything.
        for piece in 0..split_factor.min(self.len) {
            let (piece_start, piece_end) = chunk_bounds(self.len, split_factor, piece);
            let (start, end) = chunk_bounds(piece_end - piece_start, parts, coord);
            for run in self
                .slice_positions(piece_start + start, piece_start + end)
                .runs()
            {
                out.push(run.start, run.end);
            }
        }
        out
    }

    /// The indices present in both sets.
    pub fn intersect(&self, other: &IndexRuns) -> IndexRuns {
        let mut out = IndexRuns::empty();
        let (mut i, mut j) = (0, 0);
        while i < self.runs.len() && j < other.runs.len() {
            let (a, b) = (&self.runs[i], &other.runs[j]);
            out.push(a.start.max(b.start), a.end.min(b.end));
            if a.end <= b.end {
                i += 1;
            } else {
                j += 1;
            }
        }
        out
    }

    /// Splits this set into maximal pieces that are contiguous in global indices and also in
    /// the local positions of each of `holders` (sets that contain this one). Each piece is
    /// `(global start, length)`; pieces come in increasing order.
    pub fn contiguous_pieces(&self, holders: &[&IndexRuns]) -> Vec<(u64, u64)> {
        let mut pieces = Vec::new();
        self.contiguous_pieces_into(holders, &mut pieces);
        pieces
    }

    /// [`IndexRuns::contiguous_pieces`], appended to `pieces`.
    pub fn contiguous_pieces_into(&self, holders: &[&IndexRuns], pieces: &mut Vec<(u64, u64)>) {
        for run in self.runs.iter() {
            let mut start = run.start;
            while start < run.end {
                let mut end = run.end;
                for holder in holders {
                    let i = holder.runs.partition_point(|r| r.end <= start);
                    if let Some(h) = holder.runs.get(i) {
                        end = end.min(h.end);
                    }
                }
                debug_assert!(end > start, "holder sets must contain the set they split");
                if end <= start {
                    break;
                }
                pieces.push((start, end - start));
                start = end;
            }
        }
    }

    /// Splits the set by local position into `parts` nearly equal consecutive pieces
    /// (sizes differ by at most one, larger first). Empty pieces are kept so that part numbers
    /// stay aligned with the caller's assignment.
    pub fn split_even(&self, parts: u64) -> Vec<IndexRuns> {
        let base = self.len / parts;
        let extra = self.len % parts;
        let mut start = 0;
        (0..parts)
            .map(|p| {
                let size = base + u64::from(p < extra);
                let piece = self.slice_positions(start, start + size);
                start += size;
                piece
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(runs: &IndexRuns) -> Vec<u64> {
        runs.runs().iter().flat_map(|r| r.start..r.end).collect()
    }

    #[test]
    fn chunk_bounds_follow_torch_chunk() {
        let sizes = |len, parts| -> Vec<u64> {
            (0..parts)
                .map(|c| {
                    let (a, b) = chunk_bounds(len, parts, c);
                    b - a
                })
                .collect()
        };
        assert_eq!(sizes(5, 4), [2, 2, 1, 0]);
        assert_eq!(sizes(6, 4), [2, 2, 2, 0]);
        assert_eq!(sizes(7, 4), [2, 2, 2, 1]);
        assert_eq!(sizes(0, 3), [0, 0, 0]);
        assert_eq!(sizes(1, 3), [1, 0, 0]);
    }

    #[test]
    fn strided_shard_of_eight_rows_interleaves() {
        let rows = IndexRuns::full(8);
        assert_eq!(expand(&rows.strided_shard(2, 0, 2)), [0, 1, 4, 5]);
        assert_eq!(expand(&rows.strided_shard(2, 1, 2)), [2, 3, 6, 7]);
    }

    #[test]
    fn positions_round_trip() {
        let set = IndexRuns::from_ranges([(2, 5), (9, 10), (12, 20)]);
        for (pos, index) in expand(&set).into_iter().enumerate() {
            assert_eq!(set.index_at(pos as u64), Some(index));
            assert_eq!(set.position_of(index), Some(pos as u64));
        }
        assert_eq!(set.position_of(6), None);
        assert_eq!(expand(&set.slice_positions(2, 6)), [4, 9, 12, 13]);
    }

    #[test]
    fn contiguous_pieces_break_at_holder_runs() {
        let holder = IndexRuns::from_ranges([(0, 4), (6, 10)]);
        let other = IndexRuns::from_ranges([(0, 2), (3, 8)]);
        let set = holder.intersect(&other);
        assert_eq!(expand(&set), [0, 1, 3, 6, 7]);
        assert_eq!(
            set.contiguous_pieces(&[&holder, &other]),
            [(0, 2), (3, 1), (6, 2)]
        );
    }
}
