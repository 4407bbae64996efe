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
//! copies' strided byte sets (`bytesets.rs`, conservative: a pair it cannot decide within
//! the program's work budget counts as overlapping, and its unpack stays early).

use super::bytesets::{ByteSet, Reads};
use super::config::ROUND_TARGET_BYTES;
use super::fxhash::FxHashMap;
use super::messages::staging_aligned;
use super::program::{RankProgram, RoundSpan};
use super::steps::{Buffer, CopyDim, Loc, StridedCopy};

/// Most comparisons (pairs of an unpack and a later read, and pieces they are cut into)
/// [`overlap_unpacks`] makes in one program before it leaves the program as it is. Real refits
/// need a few thousand (Qwen3-32B → TP1×DP16: 3,350 pairs on its busiest rank).
const WORK_MAX: u64 = 1 << 22;

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
