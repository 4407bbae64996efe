//! Block geometry: an assignment's region → boxes contiguous on both ends → strided copies.
//!
//! An [`Assignment`]'s region is cut per dim into pieces contiguous in the sender's and the
//! receiver's local positions; the Cartesian product of pieces gives the [`Block`]s, each with
//! the strided copy (sender's view → receiver's destination view) that moves it.

use super::steps::{Buffer, CopyDim, Loc, StridedCopy};
use crate::layout::{next_index, IndexRuns, RankView};

/// A box of an [`Assignment`](super::Assignment)'s region (`start`, `count` per dim, global
/// indices) that is contiguous per dim in both ranks' local positions, with the
/// [`StridedCopy`] that moves it from the sender's view (its source view, or for a relay its
/// destination view) to the receiver's destination view.
///
/// Blocks are what a rank's data movement is made of: the rounds cut each block into
/// [`Transfer`](super::Transfer)s (one per round it moves in, usually one), which the rank's
/// program forms its messages from and `ncclReshardPlanGetTransfers` exports; a
/// `ncclReshardTransfer_t`'s `globalStart`/`globalCount` and `blockBytes` describe its block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// The tensor's index in the plan.
    pub tensor: u32,
    /// The rank whose view the data is read from.
    pub from: u32,
    /// The rank whose view it is written to.
    pub to: u32,
    /// The box's first global index per dim.
    pub start: Vec<u64>,
    /// The box's elements per dim.
    pub count: Vec<u64>,
    /// The box as bytes: from the sender's view to the receiver's.
    pub copy: StridedCopy,
    /// The round the unit fixed for this data (relays), or `None`: see
    /// [`Assignment::round`](super::Assignment::round).
    pub round: Option<u32>,
}

impl Block {
    /// This block as it is for tensor `tensor` of the same class (same layouts, shape and
    /// dtype), with the round its assignment fixed.
    pub(crate) fn of_tensor(&self, tensor: u32, round: Option<u32>) -> Block {
        Block {
            tensor,
            from: self.from,
            to: self.to,
            start: self.start.clone(),
            count: self.count.clone(),
            copy: self.copy_of_tensor(tensor),
            round,
        }
    }

    /// This block's copy as it is for tensor `tensor` of the same class.
    pub(crate) fn copy_of_tensor(&self, tensor: u32) -> StridedCopy {
        self.copy.clone().of_tensor(tensor)
    }
}

/// What a rank's transfers and program need of a block: its two ranks, the round its unit
/// fixed, its tensor and its copy (whose tensor fields may name another tensor of the class:
/// [`Moved::tensor`] is the one). [`Block`] has it, and so does the lighter [`Move`] that a
/// rank's program is planned from (the box of the tensor only the transfer export needs).
pub(crate) trait Moved {
    fn ends(&self) -> (u32, u32);
    fn fixed_round(&self) -> Option<u32>;
    fn tensor(&self) -> u32;
    fn copy(&self) -> &StridedCopy;
}

impl Moved for Block {
    fn ends(&self) -> (u32, u32) {
        (self.from, self.to)
    }

    fn fixed_round(&self) -> Option<u32> {
        self.round
    }

    fn tensor(&self) -> u32 {
        self.tensor
    }

    fn copy(&self) -> &StridedCopy {
        &self.copy
    }
}

/// A block of tensor `tensor` as its class's block `block` (another tensor's) describes it:
/// what [`Planner::rank_program`](super::Planner::rank_program) plans with, without copying
/// the block.
pub(crate) struct Move<'a> {
    pub tensor: u32,
    pub round: Option<u32>,
    pub block: &'a Block,
}

impl Moved for Move<'_> {
    fn ends(&self) -> (u32, u32) {
        (self.block.from, self.block.to)
    }

    fn fixed_round(&self) -> Option<u32> {
        self.round
    }

    fn tensor(&self) -> u32 {
        self.tensor
    }

    fn copy(&self) -> &StridedCopy {
        &self.block.copy
    }
}

/// Who moves one assignment's data: tensor, sender, receiver, the round the unit fixed, and
/// whether the sender forwards from its destination view (a relay).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Movement {
    pub tensor: u32,
    pub from: u32,
    pub to: u32,
    pub round: Option<u32>,
    pub relay: bool,
}

/// The blocks of one assignment — `region` moved as `movement` says — between the sender's
/// view `src` and the receiver's view `dst`, in row-major order of the blocks.
pub(crate) fn assignment_blocks(
    region: &[IndexRuns],
    movement: Movement,
    src: &RankView,
    dst: &RankView,
) -> Vec<Block> {
    let mut blocks = Vec::new();
    assignment_blocks_into(&mut blocks, region, movement, src, dst, true);
    blocks
}

/// [`assignment_blocks`], appended to `out`, with their boxes (`start`, `count`) only when
/// `boxes` is set (empty otherwise). A rank's planning calls it once per assignment it takes
/// part in (tens of thousands at thousands of ranks): its working lists are two allocations,
/// whatever the number of dims, and a rank's program needs no boxes.
pub(crate) fn assignment_blocks_into(
    out: &mut Vec<Block>,
    region: &[IndexRuns],
    movement: Movement,
    src: &RankView,
    dst: &RankView,
    boxes: bool,
) {
    let ndim = region.len();
    // Each dim's contiguous pieces, one list: dim d's are pieces[bounds[d]..bounds[d + 1]].
    let mut pieces: Vec<(u64, u64)> = Vec::new();
    // One working list: the piece chosen in each dim, the block's first position in either
    // view, and where each dim's pieces start in `pieces` (ndim + 1 bounds).
    let mut at = vec![0u64; 3 * ndim + (ndim + 1)];
    let (choice, rest) = at.split_at_mut(ndim);
    let (src_pos, rest) = rest.split_at_mut(ndim);
    let (dst_pos, bounds) = rest.split_at_mut(ndim);
    for d in 0..ndim {
        region[d].contiguous_pieces_into(&[&src.indices[d], &dst.indices[d]], &mut pieces);
        bounds[d + 1] = pieces.len() as u64;
        if bounds[d + 1] == bounds[d] {
            return;
        }
    }
    let piece = |d: usize, choice: &[u64]| pieces[(bounds[d] + choice[d]) as usize];
    let mut dims = Vec::with_capacity(ndim);
    loop {
        dims.clear();
        for d in 0..ndim {
            let (start, len) = piece(d, choice);
            src_pos[d] = src.indices[d]
                .position_of(start)
                .expect("sender holds its region");
            dst_pos[d] = dst.indices[d]
                .position_of(start)
                .expect("receiver holds its region");
            dims.push(CopyDim {
                count: len,
                src_stride: src.view.byte_stride(d),
                dst_stride: dst.view.byte_stride(d),
            });
        }
        let copy = StridedCopy::new(
            Loc {
                buffer: if movement.relay {
                    Buffer::Dst
                } else {
                    Buffer::Src
                },
                tensor: movement.tensor,
                offset: src.view.byte_offset(src_pos),
            },
            Loc {
                buffer: Buffer::Dst,
                tensor: movement.tensor,
                offset: dst.view.byte_offset(dst_pos),
            },
            src.view.elem_size,
            &dims,
        );
        let (start, count) = if boxes {
            (0..ndim).map(|d| piece(d, choice)).unzip()
        } else {
            (Vec::new(), Vec::new())
        };
        out.push(Block {
            tensor: movement.tensor,
            from: movement.from,
            to: movement.to,
            start,
            count,
            copy,
            round: movement.round,
        });
        if !next_index(choice, |d| bounds[d + 1] - bounds[d]) {
            return;
        }
    }
}
