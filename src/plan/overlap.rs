//! Overlapping unpacks with the next round (docs/architecture.md, "Overlapping unpacks").
//!
//! A staged rank runs each round as packs → one NCCL group → unpacks. Most of what it unpacks
//! is needed by nobody after the round: only relays read their destination views again, to
//! forward what arrived. [`overlap_unpacks`] marks a round's unpacks *late* when no later
//! round's pack or send reads what they write, and moves the staging regions they read (the
//! receives that land there) into one of two extra arenas, alternating by round, so the next
//! round's receives and packs cannot overwrite them. An executor may then run late unpacks on
//! a second stream beside the next round's transfers, as long as they finish before the round
//! after next starts (which reuses their arena) and before the call ends.
//!
//! A relay forwards in round `r + 1` what arrived in round `r`, packing it from its destination
//! view, so the unpack that writes it there must finish first. When the receive it arrived in
//! moves into an arena, the forward's pack reads the same bytes there instead (the arena holds
//! them until the round after next), and that unpack may be late too ([`staged_forwards`]);
//! a forward that is a message of its own is then sent straight from the arena
//! ([`send_from_arenas`]).
//!
//! A pure rewrite of one rank's program: its messages keep their order, sizes and peers, so
//! peers need not know. Decided from the program alone, with interval arithmetic on the
//! copies' strided byte sets ([`may_overlap`], conservative: a pair it cannot decide within
//! the program's work budget counts as overlapping, and its unpack stays early).

use super::config::ROUND_TARGET_BYTES;
use super::fxhash::FxHashMap;
use super::messages::staging_aligned;
use super::program::{RankProgram, RoundSpan};
use super::steps::{Buffer, CopyDim, Loc, StridedCopy};

/// One side of a copy or a message as a set of bytes of one buffer: `chunk` bytes at
/// `offset + Σ i_d · stride_d` for `0 ≤ i_d < count_d` (outermost first).
#[derive(Clone, Debug, PartialEq, Eq)]
struct ByteSet {
    offset: u64,
    chunk: u64,
    /// (count, stride) per dim, outermost first.
    dims: Vec<(u64, u64)>,
}

impl ByteSet {
    /// `bytes` contiguous bytes at `offset`.
    fn run(offset: u64, bytes: u64) -> ByteSet {
        ByteSet {
            offset,
            chunk: bytes,
            dims: Vec::new(),
        }
    }

    /// The bytes a copy reads (`src`) or writes.
    fn of_copy(copy: &StridedCopy, src: bool) -> ByteSet {
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
    fn extent_len(&self) -> u64 {
        let (lo, hi) = self.extent();
        (hi - lo) as u64
    }

    fn is_empty(&self) -> bool {
        self.chunk == 0 || self.dims.iter().any(|&(count, _)| count == 0)
    }

    /// The smallest interval holding the set (empty sets: an empty interval).
    fn extent(&self) -> (u128, u128) {
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
    fn outer_pieces(&self) -> impl Iterator<Item = ByteSet> + '_ {
        let (count, stride) = self.dims[0];
        (0..count).map(move |i| ByteSet {
            offset: self.offset + i * stride,
            chunk: self.chunk,
            dims: self.dims[1..].to_vec(),
        })
    }
}

/// Most comparisons (pairs of an unpack and a later read, and pieces they are cut into)
/// [`overlap_unpacks`] makes in one program before it leaves the program as it is. Real refits
/// need a few thousand (Qwen3-32B → TP1×DP16: 3,350 pairs on its busiest rank).
const WORK_MAX: u64 = 1 << 22;

/// Whether two byte sets of one buffer may share a byte: exact for contiguous runs and for
/// sets of one dim (rows of any stride against rows of the same stride, or against a run);
/// sets of more dims, or rows of different strides, are cut into their outermost entries, each
/// paid from `budget`; once it runs out the answer is `true` (conservative).
/// The reads of one buffer (a tensor's destination view, or the workspace) by later steps of
/// a program, by where their extents start, so that a write meets only the reads whose
/// extents reach it (a rank forwarding thousands of pieces of a tensor reads it thousands of
/// times).
struct Reads {
    /// (extent, round position, set), by the extent's start.
    by_start: Vec<((u128, u128), usize, ByteSet)>,
    /// The largest extent end among `by_start[..=i]`.
    end_max: Vec<u128>,
}

impl Reads {
    fn new(list: Vec<(usize, ByteSet)>) -> Reads {
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

    /// Whether a read in a round after position `k` may overlap `written` (each set compared
    /// paid from `work`, as [`may_overlap`] pays for its pieces).
    fn later_meets(&self, k: usize, written: &ByteSet, work: &mut u64) -> bool {
        let (lo, hi) = written.extent();
        if lo == hi {
            return false;
        }
        // Reads starting before the write ends, back to where none reaches into it.
        let starts_before = self
            .by_start
            .partition_point(|&((start, _), _, _)| start < hi);
        for i in (0..starts_before).rev() {
            if self.end_max[i] <= lo {
                break;
            }
            let ((_, end), round, set) = &self.by_start[i];
            if *round > k && *end > lo {
                *work = work.saturating_sub(1);
                if may_overlap(set, written, work) {
                    return true;
                }
            }
        }
        false
    }
}

fn may_overlap(a: &ByteSet, b: &ByteSet, budget: &mut u64) -> bool {
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

/// Marks late unpacks and gives the staging they read arenas of their own (see the module
/// documentation), within `limit` bytes of staging in all (and within what auto mode aims one
/// round's staging at, [`ROUND_TARGET_BYTES`], unless the program already needs more).
/// Programs of one round, rounds whose unpacks read staging regions the rewrite cannot tell
/// apart, and programs past the work budget, or where no receive fits the memory, stay as
/// they are.
pub fn overlap_unpacks(program: &mut RankProgram, limit: u64) {
    if program.round_spans.len() < 2 || !program.rounds_are_consistent() {
        return;
    }
    // Relay packs that could read what they forward from the staging it arrived in.
    let forwards = staged_forwards(program);
    // Every later read of a destination view or the workspace: (position of its round, set),
    // by (buffer, tensor). A forward that can read staging instead does not count: if the
    // receive it reads stays in the main arena, the unpack it waits for stays early anyway.
    let mut reads: FxHashMap<(Buffer, u32), Vec<(usize, ByteSet)>> = FxHashMap::default();
    let tensor_of = |loc: &Loc| match loc.buffer {
        Buffer::Work => 0,
        _ => loc.tensor,
    };
    let mut pack_at = 0usize;
    for (k, round) in program.rounds_iter().enumerate() {
        let first_pack = pack_at;
        pack_at += round.packs.len();
        for (i, copy) in round.packs.iter().enumerate() {
            if forwards.contains_key(&(first_pack + i)) {
                continue;
            }
            if matches!(copy.src.buffer, Buffer::Dst | Buffer::Work) {
                reads
                    .entry((copy.src.buffer, tensor_of(&copy.src)))
                    .or_default()
                    .push((k, ByteSet::of_copy(copy, true)));
            }
        }
        for m in round.sends {
            if matches!(m.loc.buffer, Buffer::Dst | Buffer::Work) {
                reads
                    .entry((m.loc.buffer, tensor_of(&m.loc)))
                    .or_default()
                    .push((k, ByteSet::run(m.loc.offset, m.bytes)));
            }
        }
    }
    let reads: FxHashMap<(Buffer, u32), Reads> = reads
        .into_iter()
        .map(|(key, list)| (key, Reads::new(list)))
        .collect();
    let last = program.round_spans.len() - 1;
    let mut work = WORK_MAX;
    // Per round: which of its unpacks could be late, and the staging receive each reads.
    let mut candidates: Vec<Option<Candidates>> = vec![None; program.round_spans.len()];
    let mut recv_start = 0usize;
    for (k, round) in program.rounds_iter().enumerate() {
        let recvs_here = recv_start..recv_start + round.recvs.len();
        recv_start = recvs_here.end;
        if k == last || round.unpacks.is_empty() {
            continue;
        }
        let mut is_late = |u: &StridedCopy| -> bool {
            let written = ByteSet::of_copy(u, false);
            reads
                .get(&(u.dst.buffer, tensor_of(&u.dst)))
                .map_or(true, |reads| !reads.later_meets(k, &written, &mut work))
        };
        let late: Vec<bool> = round.unpacks.iter().map(&mut is_late).collect();
        if work == 0 {
            // Pathological programs (many pieces of one tensor unpacked and forwarded, sets of
            // many dims): not worth the planning time.
            return;
        }
        if !late.iter().any(|&l| l) {
            continue;
        }
        // The staging receives of the round, and which of them late unpacks read.
        // By offset: staging regions of one round are disjoint.
        let mut staged: Vec<usize> = recvs_here
            .clone()
            .filter(|&i| program.recvs[i].loc.buffer == Buffer::Staging)
            .collect();
        staged.sort_unstable_by_key(|&i| program.recvs[i].loc.offset);
        let region_of = |u: &StridedCopy| -> Option<usize> {
            let (lo, hi) = ByteSet::of_copy(u, true).extent();
            let at = staged.partition_point(|&i| u128::from(program.recvs[i].loc.offset) <= lo);
            let i = *staged.get(at.checked_sub(1)?)?;
            let m = &program.recvs[i];
            (hi <= u128::from(m.loc.offset) + u128::from(m.bytes)).then_some(i)
        };
        let region: Option<Vec<usize>> = round
            .unpacks
            .iter()
            .map(|u| {
                (u.src.buffer == Buffer::Staging)
                    .then(|| region_of(u))
                    .flatten()
            })
            .collect();
        let Some(region) = region else {
            continue;
        };
        let mut recvs: Vec<usize> = region
            .iter()
            .zip(&late)
            .filter_map(|(&i, &l)| l.then_some(i))
            .collect();
        recvs.sort_unstable();
        recvs.dedup();
        // Largest first: the receives a capped arena takes (`Candidates::within`).
        recvs.sort_by_key(|&i| std::cmp::Reverse(program.recvs[i].bytes));
        candidates[k] = Some(Candidates {
            late,
            region,
            recvs,
        });
    }
    if candidates.iter().all(Option::is_none) {
        return;
    }
    // Memory: the whole staging must stay within what auto mode aims one round's staging at
    // (or within what the program already needs, if more) and within the caller's limit: the
    // overlap is worth a few percent of a call, not gigabytes of somebody's KV cache. When
    // moving every candidate would pass it, each round moves only the largest receives that
    // fit a cap, the largest cap that keeps the whole within it (found by bisection; the rest
    // of the round's unpacks stay early).
    let budget = program.staging_bytes.max(ROUND_TARGET_BYTES).min(limit);
    let cap_all = candidates
        .iter()
        .flatten()
        .map(|c| c.footprint(program))
        .max()
        .unwrap_or(0);
    let mut layout = Layout::new(program, &candidates, cap_all);
    if layout.total > budget {
        let (mut fits, mut over) = (0u64, cap_all);
        // To a 256th of the largest round's candidates: 8 or 9 layouts of the program.
        let resolution = (cap_all / 256).max(1);
        let mut best: Option<Layout> = None;
        while over - fits > resolution {
            let cap = fits + (over - fits) / 2;
            let tried = Layout::new(program, &candidates, cap);
            if tried.total <= budget {
                fits = cap;
                best = Some(tried);
            } else {
                over = cap;
            }
        }
        match best {
            Some(b) if b.moved.iter().any(|&m| m) => layout = b,
            _ => return,
        }
    }
    let Layout {
        relocated,
        moved,
        main,
        arenas,
        total,
    } = layout;
    let spans = program.round_spans.clone();
    main_locs(program, &spans, &moved, |k, loc, _| {
        loc.offset = relocated[k].squeeze(loc.offset);
    });
    // The arenas follow the main one; parity 1's follows parity 0's.
    let base = [main, main + arenas[0]];
    for (k, round) in relocated.iter().enumerate() {
        for m in &round.moved {
            program.recvs[m.recv].loc.offset = base[k % 2] + m.to;
        }
    }
    // Reorder each round's unpacks (early first: those not late, and late ones whose receive
    // stayed in the main arena) and point them at their regions' new places.
    let mut unpack_start = 0usize;
    for (k, span) in spans.iter().enumerate() {
        let end = span.unpacks_end;
        let old: Vec<StridedCopy> = program.unpacks[unpack_start..end].to_vec();
        let late: Vec<bool> = match &candidates[k] {
            Some(c) => c
                .late
                .iter()
                .zip(&c.region)
                .map(|(&l, &i)| l && moved[i])
                .collect(),
            None => vec![false; old.len()],
        };
        let mut order: Vec<usize> = (0..old.len()).filter(|&i| !late[i]).collect();
        let early = order.len();
        order.extend((0..old.len()).filter(|&i| late[i]));
        for (slot, &at) in order.iter().enumerate() {
            let mut u = old[at].clone();
            if u.src.buffer == Buffer::Staging {
                match relocated[k].holding(u.src.offset) {
                    Some(m) => u.src.offset = base[k % 2] + m.to + (u.src.offset - m.from),
                    None => u.src.offset = relocated[k].squeeze(u.src.offset),
                }
            }
            program.unpacks[unpack_start + slot] = u;
        }
        program.round_spans[k].late_unpacks = old.len() - early;
        unpack_start = end;
    }
    // Forwards whose data arrived in a moved receive read it there (the arena holds it until
    // the round after next), not in the destination view its late unpack writes.
    let mut from_arena: Vec<usize> = Vec::new();
    for (&pack, (k, u, unpack)) in &forwards {
        let (k, u) = (*k, *u);
        let Some(c) = &candidates[k] else { continue };
        if !moved[c.region[u]] {
            continue;
        }
        let m = relocated[k]
            .holding(unpack.src.offset)
            .expect("a moved receive holds what its unpack reads");
        let src = Loc {
            offset: base[k % 2] + m.to + (unpack.src.offset - m.from),
            ..unpack.src
        };
        let p = &program.packs[pack];
        let dims: Vec<CopyDim> = p
            .dims
            .iter()
            .zip(&unpack.dims)
            .map(|(d, ud)| CopyDim {
                count: d.count,
                src_stride: ud.src_stride,
                dst_stride: d.dst_stride,
            })
            .collect();
        program.packs[pack] = StridedCopy::new(src, p.dst, p.chunk_bytes, &dims);
        from_arena.push(pack);
    }
    send_from_arenas(program, from_arena);
    program.staging_bytes = total;
}

/// Forwards sent straight from the arena: a pack from an arena that copies one contiguous run
/// to the run whole sends read (a relay forward to node mates travels as a message of its own,
/// `plan::messages`) is dropped, and those sends read the run where it arrived.
fn send_from_arenas(program: &mut RankProgram, mut packs: Vec<usize>) {
    packs.sort_unstable();
    let spans = program.round_spans.clone();
    let mut dropped = vec![false; program.packs.len()];
    let mut from = RoundSpan::default();
    let mut next = packs.into_iter().peekable();
    for span in &spans {
        if next.peek().is_some_and(|&p| p < span.packs_end) {
            // The round's staged sends by the run they read: the distinct runs by start, with
            // the furthest end of those before each (a run overlapping an earlier one is
            // found without scanning them), and the sends reading each.
            let mut readers: FxHashMap<(u64, u64), Vec<usize>> = FxHashMap::default();
            for i in from.sends_end..span.sends_end {
                let m = &program.sends[i];
                if m.loc.buffer == Buffer::Staging {
                    let run = (m.loc.offset, m.loc.offset + m.bytes);
                    readers.entry(run).or_default().push(i);
                }
            }
            let mut runs: Vec<(u64, u64)> = readers.keys().copied().collect();
            runs.sort_unstable();
            let reach: Vec<u64> = std::iter::once(0)
                .chain(runs.iter().scan(0u64, |end, r| {
                    *end = (*end).max(r.1);
                    Some(*end)
                }))
                .collect();
            while let Some(pack) = next.next_if(|&p| p < span.packs_end) {
                let p = &program.packs[pack];
                if !p.dims.is_empty() || p.dst.buffer != Buffer::Staging {
                    continue;
                }
                let run = (p.dst.offset, p.dst.offset + p.chunk_bytes);
                // Only whole sends read the run: it is a run of its own, the only one starting
                // inside it, and no earlier run reaches into it.
                let at = runs.partition_point(|r| r.0 < run.0);
                let inside = runs[at..].partition_point(|r| r.0 < run.1);
                if inside != 1 || runs[at] != run || reach[at] > run.0 {
                    continue;
                }
                for &i in &readers[&run] {
                    program.sends[i].loc = p.src;
                }
                dropped[pack] = true;
            }
        }
        from = *span;
    }
    if !dropped.iter().any(|&d| d) {
        return;
    }
    // Each round's packs end where its kept packs do.
    let (mut start, mut gone) = (0usize, 0usize);
    for (k, span) in spans.iter().enumerate() {
        gone += dropped[start..span.packs_end]
            .iter()
            .filter(|&&d| d)
            .count();
        program.round_spans[k].packs_end = span.packs_end - gone;
        start = span.packs_end;
    }
    let mut index = 0usize;
    program.packs.retain(|_| {
        index += 1;
        !dropped[index - 1]
    });
}

/// Relay packs (a forward reading its destination view) whose bytes an unpack of the round
/// before wrote from staging with the same geometry: pack index → (round position of the
/// unpack, its index in the round, the unpack as planned).
fn staged_forwards(program: &RankProgram) -> FxHashMap<usize, (usize, usize, StridedCopy)> {
    let mut out = FxHashMap::default();
    let rounds = program.rounds();
    let mut pack_at = rounds.first().map_or(0, |r| r.packs.len());
    for k in 1..rounds.len() {
        let (before, round) = (&rounds[k - 1], &rounds[k]);
        let first_pack = pack_at;
        pack_at += round.packs.len();
        if !round.packs.iter().any(|p| p.src.buffer == Buffer::Dst) {
            continue;
        }
        let by_dst: FxHashMap<(u32, u64), usize> = before
            .unpacks
            .iter()
            .enumerate()
            .filter(|(_, u)| u.src.buffer == Buffer::Staging && u.dst.buffer == Buffer::Dst)
            .map(|(i, u)| ((u.dst.tensor, u.dst.offset), i))
            .collect();
        for (i, p) in round.packs.iter().enumerate() {
            if p.src.buffer != Buffer::Dst {
                continue;
            }
            let Some(&u) = by_dst.get(&(p.src.tensor, p.src.offset)) else {
                continue;
            };
            let unpack = &before.unpacks[u];
            let same = unpack.chunk_bytes == p.chunk_bytes
                && unpack.dims.len() == p.dims.len()
                && unpack
                    .dims
                    .iter()
                    .zip(&p.dims)
                    .all(|(a, b)| a.count == b.count && a.dst_stride == b.src_stride);
            if same {
                out.insert(first_pack + i, (k - 1, u, unpack.clone()));
            }
        }
    }
    out
}

/// One round's unpacks that may run late: per unpack of the round, whether nothing later reads
/// what it writes (`late`) and the staging receive it reads (`region`, an index into
/// `recvs` of the program); the receives late unpacks read, largest first.
#[derive(Clone)]
struct Candidates {
    late: Vec<bool>,
    region: Vec<usize>,
    recvs: Vec<usize>,
}

impl Candidates {
    /// The receives an arena of at most `cap` bytes takes, largest first, each taken when
    /// its aligned footprint still fits (skipped otherwise), in receive order.
    fn within(&self, program: &RankProgram, cap: u64) -> Vec<usize> {
        let mut used = 0u64;
        let mut taken: Vec<usize> = Vec::new();
        for &i in &self.recvs {
            let size = staging_aligned(program.recvs[i].bytes);
            if used.saturating_add(size) <= cap {
                used += size;
                taken.push(i);
            }
        }
        taken.sort_unstable();
        taken
    }

    /// The aligned footprints of all the receives, the most an arena of the round takes.
    fn footprint(&self, program: &RankProgram) -> u64 {
        self.recvs
            .iter()
            .map(|&i| staging_aligned(program.recvs[i].bytes))
            .sum()
    }
}

/// Where staging goes when each round moves what a cap lets it: the moved receives per round,
/// which receives moved, and the main arena (squeezed), both parity arenas and their sum.
struct Layout {
    relocated: Vec<Relocated>,
    moved: Vec<bool>,
    main: u64,
    arenas: [u64; 2],
    total: u64,
}

impl Layout {
    fn new(program: &mut RankProgram, candidates: &[Option<Candidates>], cap: u64) -> Layout {
        let mut arenas = [0u64; 2];
        let mut moved = vec![false; program.recvs.len()];
        let relocated: Vec<Relocated> = candidates
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut at = 0u64;
                let list = c.as_ref().map_or(Vec::new(), |c| c.within(program, cap));
                let list: Vec<Moved> = list
                    .into_iter()
                    .map(|recv| {
                        let m = &program.recvs[recv];
                        let to = staging_aligned(at);
                        at = to + m.bytes;
                        moved[recv] = true;
                        Moved {
                            recv,
                            from: m.loc.offset,
                            end: m.loc.offset + m.bytes,
                            to,
                        }
                    })
                    .collect();
                arenas[k % 2] = arenas[k % 2].max(at);
                Relocated::new(list)
            })
            .collect();
        // Each round's main arena closes the gaps the moved regions leave (`squeeze`).
        let spans = program.round_spans.clone();
        let mut main = 0u64;
        main_locs(program, &spans, &moved, |k, loc, len| {
            main = main.max(relocated[k].squeeze(loc.offset) + len);
        });
        let (main, arenas) = (staging_aligned(main), arenas.map(staging_aligned));
        Layout {
            relocated,
            moved,
            main,
            arenas,
            total: main + arenas[0] + arenas[1],
        }
    }
}

/// A staging receive moved into its round's arena: its index in `recvs`, where it was
/// (`from..end` of the main arena) and where it goes (`to`, from the arena's start).
#[derive(Clone)]
struct Moved {
    recv: usize,
    from: u64,
    end: u64,
    to: u64,
}

/// One round's moved receives by offset (a round's staging regions are disjoint), with the
/// footprints below each: a location is squeezed in a search, not a pass over every moved
/// region (a forwarding rank moves hundreds per round).
struct Relocated {
    moved: Vec<Moved>,
    /// `below[i]`: the (aligned) footprints of `moved[..i]`.
    below: Vec<u64>,
}

impl Relocated {
    fn new(mut moved: Vec<Moved>) -> Relocated {
        moved.sort_unstable_by_key(|m| m.from);
        let below = std::iter::once(0)
            .chain(moved.iter().scan(0u64, |sum, m| {
                *sum += staging_aligned(m.end) - m.from;
                Some(*sum)
            }))
            .collect();
        Relocated { moved, below }
    }

    /// `x`, an offset of the round's staging outside the moved regions, once the moved
    /// regions' (aligned) footprints below it are taken out.
    fn squeeze(&self, x: u64) -> u64 {
        x - self.below[self.moved.partition_point(|m| m.end <= x)]
    }

    /// The moved region holding offset `x`, if any.
    fn holding(&self, x: u64) -> Option<&Moved> {
        let at = self.moved.partition_point(|m| m.from <= x);
        self.moved[..at].last().filter(|m| x < m.end)
    }
}

/// Calls `f(round position, location, bytes)` for every staging location of the main arena:
/// pack outputs, staged sends, and staging receives not `moved`.
fn main_locs(
    program: &mut RankProgram,
    spans: &[RoundSpan],
    moved: &[bool],
    mut f: impl FnMut(usize, &mut Loc, u64),
) {
    let mut from = RoundSpan::default();
    for (k, span) in spans.iter().enumerate() {
        for c in &mut program.packs[from.packs_end..span.packs_end] {
            if c.dst.buffer == Buffer::Staging {
                let len = ByteSet::of_copy(c, false).extent_len();
                f(k, &mut c.dst, len);
            }
        }
        for m in &mut program.sends[from.sends_end..span.sends_end] {
            if m.loc.buffer == Buffer::Staging {
                f(k, &mut m.loc, m.bytes);
            }
        }
        let range = from.recvs_end..span.recvs_end;
        for (m, &moved) in program.recvs[range.clone()].iter_mut().zip(&moved[range]) {
            if m.loc.buffer == Buffer::Staging && !moved {
                f(k, &mut m.loc, m.bytes);
            }
        }
        from = *span;
    }
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
