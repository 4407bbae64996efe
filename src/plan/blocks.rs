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
    /// The round the unit fixed for this data (relays), or `None`: see [`Assignment::round`].
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
    let assignment = movement;
    let ndim = region.len();
    let pieces: Vec<Vec<(u64, u64)>> = (0..ndim)
        .map(|d| region[d].contiguous_pieces(&[&src.indices[d], &dst.indices[d]]))
        .collect();
    if pieces.iter().any(Vec::is_empty) {
        return Vec::new();
    }
    let src_strides = src.view.byte_strides();
    let dst_strides = dst.view.byte_strides();
    let mut copies = Vec::new();
    let mut choice = vec![0usize; ndim];
    let mut src_pos = vec![0u64; ndim];
    let mut dst_pos = vec![0u64; ndim];
    let mut dims = vec![
        CopyDim {
            count: 0,
            src_stride: 0,
            dst_stride: 0
        };
        ndim
    ];
    loop {
        for d in 0..ndim {
            let (start, len) = pieces[d][choice[d]];
            src_pos[d] = src.indices[d]
                .position_of(start)
                .expect("sender holds its region");
            dst_pos[d] = dst.indices[d]
                .position_of(start)
                .expect("receiver holds its region");
            dims[d] = CopyDim {
                count: len,
                src_stride: src_strides[d],
                dst_stride: dst_strides[d],
            };
        }
        let copy = StridedCopy::new(
            Loc {
                buffer: if assignment.relay {
                    Buffer::Dst
                } else {
                    Buffer::Src
                },
                tensor: assignment.tensor,
                offset: src.view.byte_offset(&src_pos),
            },
            Loc {
                buffer: Buffer::Dst,
                tensor: assignment.tensor,
                offset: dst.view.byte_offset(&dst_pos),
            },
            src.view.elem_size,
            &dims,
        );
        copies.push(Block {
            tensor: assignment.tensor,
            from: assignment.from,
            to: assignment.to,
            start: (0..ndim).map(|d| pieces[d][choice[d]].0).collect(),
            count: (0..ndim).map(|d| pieces[d][choice[d]].1).collect(),
            copy,
            round: assignment.round,
        });
        if !next_index(&mut choice, |d| pieces[d].len()) {
            return copies;
        }
    }
}
