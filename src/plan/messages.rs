//! Message forming: a pair's copies → messages, packs and unpacks.
//!
//! The messages of one (sender, receiver) pair are derived from that pair's copies (the
//! [`Transfer`](super::Transfer)s of its blocks in one round) by one function both sides run,
//! so their sizes and order agree. Depending on the mode a run goes as it is (groupable), is
//! packed into staging by the sender, or the whole pair travels as one staged message that the
//! receiver unpacks.

use super::config::{
    Mode, AUTO_DIRECT_PART_FRACTION, AUTO_STAGE_MAX_AVG_BYTES, AUTO_STAGE_MAX_MESSAGES,
    AUTO_STAGE_MIN_MESSAGES, GROUPABLE_MAX_MESSAGES_PER_RANK, GROUPABLE_MAX_PIECES_PER_PAIR,
};
use super::fxhash::FxHashMap;
use super::program::Message;
use super::steps::{Buffer, CopyDim, Loc, StridedCopy};
use crate::error::{Error, Result};
use crate::layout::next_index;

/// Staging regions start at multiples of this many bytes (vector-friendly for kernels).
pub const STAGING_ALIGN: u64 = 256;

/// `x` rounded up to a multiple of [`STAGING_ALIGN`].
pub(crate) fn staging_aligned(x: u64) -> u64 {
    x.div_ceil(STAGING_ALIGN) * STAGING_ALIGN
}

/// One destination-contiguous piece of a copy: `bytes` bytes landing at `dst`, read from
/// `src` through `src_dims` (empty when the source side is contiguous too).
struct Piece {
    src: Loc,
    dst: Loc,
    chunk_bytes: u64,
    src_dims: Vec<CopyDim>,
    bytes: u64,
}

/// Splits a copy at the outermost dims where the destination stops being contiguous.
fn dst_contiguous_split(copy: &StridedCopy) -> (usize, u64) {
    let mut run = copy.chunk_bytes;
    let mut k = copy.dims.len();
    while k > 0 && copy.dims[k - 1].dst_stride == run {
        run *= copy.dims[k - 1].count;
        k -= 1;
    }
    (k, run)
}

/// Number of destination-contiguous pieces (groupable messages before merging) of a copy.
fn groupable_piece_count(copy: &StridedCopy) -> u64 {
    let (k, _) = dst_contiguous_split(copy);
    copy.dims[..k].iter().map(|d| d.count).product()
}

/// Number of runs contiguous on both ends (groupable messages before merging) of a copy: its
/// chunks, since `StridedCopy::new` folds every dim contiguous on both ends into the chunk.
fn direct_piece_count(copy: &StridedCopy) -> u64 {
    copy.dims
        .iter()
        .fold(1u64, |acc, d| acc.saturating_mul(d.count))
}

fn for_each_piece(copy: &StridedCopy, mut f: impl FnMut(Piece)) {
    let (k, bytes) = dst_contiguous_split(copy);
    let outer = &copy.dims[..k];
    let inner = &copy.dims[k..];
    let mut index = vec![0u64; k];
    loop {
        let src_off: u64 = outer
            .iter()
            .zip(&index)
            .map(|(d, &i)| i * d.src_stride)
            .sum();
        let dst_off: u64 = outer
            .iter()
            .zip(&index)
            .map(|(d, &i)| i * d.dst_stride)
            .sum();
        f(Piece {
            src: Loc {
                offset: copy.src.offset + src_off,
                ..copy.src
            },
            dst: Loc {
                offset: copy.dst.offset + dst_off,
                ..copy.dst
            },
            chunk_bytes: copy.chunk_bytes,
            src_dims: inner.to_vec(),
            bytes,
        });
        if !next_index(&mut index, |d| outer[d].count) {
            return;
        }
    }
}

/// A copy of `dims` behind `chunk_bytes`-byte chunks between a strided side and dense staging
/// bytes: `dims` with the staging side's strides replaced by dense row-major ones
/// (`staging_is_dst` says which side that is).
fn dense_copy(
    src: Loc,
    dst: Loc,
    chunk_bytes: u64,
    dims: &[CopyDim],
    staging_is_dst: bool,
) -> StridedCopy {
    // Copies have at most one dim per tensor dim: build them on the stack.
    const STACK_DIMS: usize = 8;
    let mut stack = [CopyDim {
        count: 0,
        src_stride: 0,
        dst_stride: 0,
    }; STACK_DIMS];
    let mut heap = Vec::new();
    let out: &mut [CopyDim] = if dims.len() <= STACK_DIMS {
        &mut stack[..dims.len()]
    } else {
        heap.resize(dims.len(), stack[0]);
        &mut heap
    };
    let mut step = chunk_bytes;
    for (slot, d) in out.iter_mut().zip(dims).rev() {
        *slot = if staging_is_dst {
            CopyDim {
                dst_stride: step,
                ..*d
            }
        } else {
            CopyDim {
                src_stride: step,
                ..*d
            }
        };
        step *= d.count;
    }
    StridedCopy::new(src, dst, chunk_bytes, out)
}

/// A copy from `src` (strided as `dims`' source side) into dense staging bytes at `at`.
fn pack(copy_src: Loc, chunk_bytes: u64, dims: &[CopyDim], at: u64) -> StridedCopy {
    let staging = Loc {
        buffer: Buffer::Staging,
        tensor: 0,
        offset: at,
    };
    dense_copy(copy_src, staging, chunk_bytes, dims, true)
}

/// A copy from dense staging bytes at `at` to `copy`'s destination.
fn unpack(copy: &StridedCopy, at: u64) -> StridedCopy {
    let staging = Loc {
        buffer: Buffer::Staging,
        tensor: 0,
        offset: at,
    };
    dense_copy(staging, copy.dst, copy.chunk_bytes, &copy.dims, false)
}

/// Which end of a pair this rank is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    Sender,
    Receiver,
}

/// One round of a rank's program being assembled: the parts each pair contributes go here,
/// in order.
#[derive(Default)]
pub(crate) struct Emitter {
    pub packs: Vec<StridedCopy>,
    pub unpacks: Vec<StridedCopy>,
    pub sends: Vec<Message>,
    pub recvs: Vec<Message>,
    /// Staging the round addresses.
    pub staging_bytes: u64,
    /// Staged sends of the round already packed, by their source side: a relay
    /// forwards the same data to every replica on its node, so it packs once and sends that
    /// region to each.
    packed: FxHashMap<Vec<(Loc, u64, Vec<CopyDim>)>, Loc>,
    /// Messages (sends and receives) groupable pairs have formed so far on this rank (a
    /// groupable plan has one round).
    groupable_messages: u64,
}

impl Emitter {
    fn reserve(&mut self, bytes: u64) -> u64 {
        let at = staging_aligned(self.staging_bytes);
        self.staging_bytes = at + bytes;
        at
    }

    fn messages(&mut self, end: End) -> &mut Vec<Message> {
        match end {
            End::Sender => &mut self.sends,
            End::Receiver => &mut self.recvs,
        }
    }

    /// Emits this rank's half of the pair whose copies (canonical order) are given.
    /// `pair` is (sender, receiver), for messages. `coalesce`: in auto mode, the plan has
    /// several rounds (so it is not groupable anyway): pieces contiguous at the destination of
    /// at least [`AUTO_STAGE_MAX_AVG_BYTES`] and 1/[`AUTO_DIRECT_PART_FRACTION`] of
    /// `part_bytes` (the plan's smallest pair part) land there, each a message of its own
    /// (the sender packs those strided at its end), the rest as one staged message, but for
    /// relay forwards between `node_mates` (copies reading the sender's destination view) that
    /// the sender would pack: each is a staged message of its own, so that a forwarder whose
    /// data still sits in the arena it arrived in sends it from there (`plan::overlap`). Both
    /// ends tell them apart from the copies and the topology alone.
    #[allow(clippy::too_many_arguments)]
    pub fn pair(
        &mut self,
        end: End,
        pair: (u32, u32),
        copies: &[&StridedCopy],
        mode: Mode,
        coalesce: bool,
        part_bytes: u64,
        node_mates: bool,
    ) -> Result<()> {
        let peer = match end {
            End::Sender => pair.1,
            End::Receiver => pair.0,
        };
        let nonempty: Vec<&StridedCopy>;
        let copies = if copies.iter().all(|c| c.bytes() > 0) {
            copies
        } else {
            nonempty = copies.iter().copied().filter(|c| c.bytes() > 0).collect();
            &nonempty
        };
        if copies.is_empty() {
            return Ok(());
        }
        let messages = || {
            copies
                .iter()
                .map(|c| groupable_piece_count(c))
                .fold(0u64, u64::saturating_add)
        };
        let staged = match mode {
            Mode::Groupable => {
                let pieces = copies
                    .iter()
                    .map(|c| direct_piece_count(c))
                    .fold(0u64, u64::saturating_add);
                if pieces > GROUPABLE_MAX_PIECES_PER_PAIR {
                    return Err(Error::invalid_usage(format!(
                        "groupable mode needs {pieces} messages from rank {} to rank {} (their regions interleave); use auto or staged mode",
                        pair.0, pair.1
                    )));
                }
                let before = self.messages(end).len();
                self.direct_pair(end, peer, copies);
                let formed = self.messages(end).len() - before;
                self.groupable_messages = self.groupable_messages.saturating_add(formed as u64);
                if self.groupable_messages > GROUPABLE_MAX_MESSAGES_PER_RANK {
                    let rank = match end {
                        End::Sender => pair.0,
                        End::Receiver => pair.1,
                    };
                    return Err(Error::invalid_usage(format!(
                        "groupable mode needs more than {GROUPABLE_MAX_MESSAGES_PER_RANK} messages on rank {rank} in one NCCL group (regions that interleave on the sending or the receiving side travel one contiguous run per message); use auto or staged mode, which pack them into few messages (called outside ncclGroupStart/End)"
                    )));
                }
                return Ok(());
            }
            Mode::Staged => true,
            Mode::Auto if coalesce => {
                // Large pieces contiguous at the destination land there, unpacked by nobody
                // (packed by the sender where its side is strided); the rest travels as one
                // staged message when it would take several.
                let min = AUTO_STAGE_MAX_AVG_BYTES.max(part_bytes / AUTO_DIRECT_PART_FRACTION);
                let is_direct = |c: &&StridedCopy| c.dst_is_contiguous() && c.bytes() >= min;
                let split: (Vec<&StridedCopy>, Vec<&StridedCopy>);
                let (direct, rest): (&[&StridedCopy], &[&StridedCopy]) =
                    match copies.iter().filter(|c| is_direct(c)).count() {
                        0 => (&[], copies),
                        n if n == copies.len() => (copies, &[]),
                        _ => {
                            split = copies.iter().partition(|c| is_direct(c));
                            (&split.0, &split.1)
                        }
                    };
                // A forward to a node mate that its sender must pack travels alone.
                let alone = |c: &StridedCopy| {
                    node_mates && c.src.buffer == Buffer::Dst && !c.src_is_contiguous()
                };
                let forwards: (Vec<&StridedCopy>, Vec<&StridedCopy>);
                let rest = if rest.iter().any(|c| alone(c)) {
                    forwards = rest.iter().partition(|c| alone(c));
                    for &c in &forwards.0 {
                        self.staged_pair(end, peer, &[c]);
                    }
                    &forwards.1[..]
                } else {
                    rest
                };
                let pieces: u64 = rest
                    .iter()
                    .map(|c| groupable_piece_count(c))
                    .fold(0u64, u64::saturating_add);
                if pieces >= 2 {
                    self.staged_pair(end, peer, rest);
                } else if !rest.is_empty() {
                    self.groupable_pair(end, peer, rest);
                }
                if !direct.is_empty() {
                    self.groupable_pair(end, peer, direct);
                }
                return Ok(());
            }
            Mode::Auto => {
                let n = messages();
                let bytes: u64 = copies.iter().map(|c| c.bytes()).sum();
                n >= AUTO_STAGE_MIN_MESSAGES
                    && (bytes / n < AUTO_STAGE_MAX_AVG_BYTES || n > AUTO_STAGE_MAX_MESSAGES)
            }
        };
        if staged {
            self.staged_pair(end, peer, copies);
        } else {
            self.groupable_pair(end, peer, copies);
        }
        Ok(())
    }

    /// Groupable mode: one message per run contiguous on both ends (a copy's chunk), adjacent
    /// runs merged; sent from the source view, received into the destination view, nothing
    /// packed. A call then holds no state between posting a message and NCCL running it, so it
    /// is correct inside a caller's group however many calls the group holds.
    fn direct_pair(&mut self, end: End, peer: u32, copies: &[&StridedCopy]) {
        let mut pending: Option<(Loc, Loc, u64)> = None;
        for c in copies {
            let mut index = vec![0u64; c.dims.len()];
            loop {
                let (mut src, mut dst) = (c.src, c.dst);
                for (d, &i) in c.dims.iter().zip(&index) {
                    src.offset += i * d.src_stride;
                    dst.offset += i * d.dst_stride;
                }
                match &mut pending {
                    Some((s, t, bytes))
                        if s.buffer == src.buffer
                            && s.tensor == src.tensor
                            && s.offset + *bytes == src.offset
                            && t.tensor == dst.tensor
                            && t.offset + *bytes == dst.offset =>
                    {
                        *bytes += c.chunk_bytes;
                    }
                    _ => {
                        if let Some(done) = pending.replace((src, dst, c.chunk_bytes)) {
                            self.push_direct(end, peer, done);
                        }
                    }
                }
                if !next_index(&mut index, |d| c.dims[d].count) {
                    break;
                }
            }
        }
        if let Some(done) = pending {
            self.push_direct(end, peer, done);
        }
    }

    fn push_direct(&mut self, end: End, peer: u32, (src, dst, bytes): (Loc, Loc, u64)) {
        let loc = match end {
            End::Sender => src,
            End::Receiver => dst,
        };
        self.messages(end).push(Message { peer, loc, bytes });
    }

    /// One message for the whole pair; zero-copy on a side where it is one contiguous run.
    fn staged_pair(&mut self, end: End, peer: u32, copies: &[&StridedCopy]) {
        let total: u64 = copies.iter().map(|c| c.bytes()).sum();
        let direct = match (end, copies) {
            (End::Sender, [c]) if c.src_is_contiguous() => Some(c.src),
            (End::Receiver, [c]) if c.dst_is_contiguous() => Some(c.dst),
            _ => None,
        };
        let source_side = || -> Vec<(Loc, u64, Vec<CopyDim>)> {
            copies
                .iter()
                .map(|c| (c.src, c.chunk_bytes, c.dims.clone()))
                .collect()
        };
        let packed_before = match (end, direct) {
            (End::Sender, None) => self.packed.get(&source_side()).copied(),
            _ => None,
        };
        let loc = match (direct, packed_before) {
            (Some(loc), _) => loc,
            (None, Some(loc)) => loc,
            (None, None) => {
                let base = self.reserve(total);
                let mut at = base;
                for c in copies {
                    match end {
                        End::Sender => self.packs.push(pack(c.src, c.chunk_bytes, &c.dims, at)),
                        End::Receiver => self.unpacks.push(unpack(c, at)),
                    }
                    at += c.bytes();
                }
                let loc = Loc {
                    buffer: Buffer::Staging,
                    tensor: 0,
                    offset: base,
                };
                if end == End::Sender {
                    self.packed.insert(source_side(), loc);
                }
                loc
            }
        };
        self.messages(end).push(Message {
            peer,
            loc,
            bytes: total,
        });
    }

    /// One message per destination-contiguous piece, adjacent pieces merged; the sender packs
    /// pieces whose source side is not contiguous.
    fn groupable_pair(&mut self, end: End, peer: u32, copies: &[&StridedCopy]) {
        // Pending message: (first piece's src, first piece's dst, bytes, packed?).
        let mut pending: Option<(Loc, Loc, u64, bool)> = None;
        let mut pending_packs: Vec<(Loc, u64, Vec<CopyDim>)> = Vec::new();
        let mut pieces = Vec::new();
        for c in copies {
            for_each_piece(c, |p| pieces.push(p));
        }
        for p in pieces {
            let packed = !p.src_dims.is_empty();
            if let Some((src, dst, bytes, was_packed)) = &mut pending {
                let dst_adjacent =
                    dst.tensor == p.dst.tensor && dst.offset + *bytes == p.dst.offset;
                let src_adjacent =
                    src.tensor == p.src.tensor && src.offset + *bytes == p.src.offset;
                if dst_adjacent && packed == *was_packed && (packed || src_adjacent) {
                    *bytes += p.bytes;
                    if packed {
                        pending_packs.push((p.src, p.chunk_bytes, p.src_dims));
                    }
                    continue;
                }
                let done = pending.take().expect("pending message");
                self.flush(end, peer, done, &mut pending_packs);
            }
            if packed {
                pending_packs.push((p.src, p.chunk_bytes, p.src_dims));
            }
            pending = Some((p.src, p.dst, p.bytes, packed));
        }
        if let Some(done) = pending {
            self.flush(end, peer, done, &mut pending_packs);
        }
    }

    fn flush(
        &mut self,
        end: End,
        peer: u32,
        (src, dst, bytes, packed): (Loc, Loc, u64, bool),
        packs: &mut Vec<(Loc, u64, Vec<CopyDim>)>,
    ) {
        let loc = match end {
            End::Receiver => dst,
            End::Sender if !packed => src,
            End::Sender => {
                let base = self.reserve(bytes);
                let mut at = base;
                for (from, chunk_bytes, dims) in packs.iter() {
                    let copy = pack(*from, *chunk_bytes, dims, at);
                    at += copy.bytes();
                    self.packs.push(copy);
                }
                Loc {
                    buffer: Buffer::Staging,
                    tensor: 0,
                    offset: base,
                }
            }
        };
        packs.clear();
        self.messages(end).push(Message { peer, loc, bytes });
    }
}
