//! `StridedConvert`: the step of a rank's program that converts a tensor's elements to its
//! destination dtype (docs/quantization.md), beside `StridedCopy`, the step that moves bytes.

use super::program::Loc;
use crate::quant::Arithmetic;

/// One tensor dim of a [`StridedConvert`]: `count` elements, `src_stride` / `dst_stride`
/// bytes apart on each side, in quantization blocks of `block` elements (1 for a cast) whose
/// scales are `scale_stride` bytes apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvertDim {
    pub count: u64,
    pub src_stride: u64,
    pub dst_stride: u64,
    pub block: u64,
    pub scale_stride: u64,
}

/// Converts a box of a tensor's elements, every dim of it (outermost first), from `src` to
/// `dst` with `arithmetic`: per quantization block, the largest magnitude of its elements
/// gives its scale (written at `scale`, the box's first block's, with the dims'
/// `scale_stride`s), and each element is divided by it and converted; a cast converts each
/// element alone.
///
/// The box holds whole blocks: along each dim it starts at a block boundary and ends at one or
/// at the tensor's edge (the planner only converts blocks a rank holds whole). The host
/// executor runs it with `crate::quant`'s functions; the GPU kernel in three passes (segment
/// amaxes, block scales, values).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StridedConvert {
    /// The tensor, and the global index of the box's first element, for messages and the
    /// exported transfers.
    pub tensor: u32,
    pub start: Vec<u64>,
    pub src: Loc,
    pub dst: Loc,
    /// Where the scales go (scaled conversions only).
    pub scale: Option<Loc>,
    pub dims: Vec<ConvertDim>,
    pub arithmetic: Arithmetic,
}

impl StridedConvert {
    /// Elements the box holds.
    pub fn elements(&self) -> u64 {
        self.dims
            .iter()
            .fold(1u64, |acc, d| acc.saturating_mul(d.count))
    }

    /// Quantization blocks the box holds (one per element for a cast).
    pub fn blocks(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, d| {
            acc.saturating_mul(d.count.div_ceil(d.block.max(1)))
        })
    }

    /// Bytes read from the source side.
    pub fn src_bytes(&self) -> u64 {
        self.elements()
            .saturating_mul(u64::from(self.arithmetic.src.size()))
    }

    /// Bytes written on the destination side (values, then scales).
    pub fn dst_bytes(&self) -> u64 {
        let values = self
            .elements()
            .saturating_mul(u64::from(self.arithmetic.dst.size()));
        let scales = match (self.scale, self.arithmetic.scale) {
            (Some(_), Some(encoding)) => self
                .blocks()
                .saturating_mul(u64::from(encoding.format.size())),
            _ => 0,
        };
        values.saturating_add(scales)
    }

    /// One past the highest byte the box touches on a side whose per-dim byte strides are
    /// given, counted from the box's start (0 for an empty box).
    pub fn reach(&self, stride: impl Fn(&ConvertDim) -> u64, elem_size: u64) -> u64 {
        if self.elements() == 0 {
            return 0;
        }
        self.dims.iter().fold(elem_size, |acc, d| {
            acc.saturating_add((d.count - 1).saturating_mul(stride(d)))
        })
    }

    /// One past the highest scale byte, counted from `scale` (0 without scales).
    pub fn scale_reach(&self) -> u64 {
        match (self.scale, self.arithmetic.scale) {
            (Some(_), Some(encoding)) if self.elements() > 0 => {
                self.dims
                    .iter()
                    .fold(u64::from(encoding.format.size()), |acc, d| {
                        acc.saturating_add(
                            (d.count.div_ceil(d.block.max(1)) - 1).saturating_mul(d.scale_stride),
                        )
                    })
            }
            _ => 0,
        }
    }
}
