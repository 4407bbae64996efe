//! The steps a rank's program is made of, and where they read and write: [`StridedCopy`]
//! moves bytes (local copies, packs, unpacks, and the copy geometry of blocks and transfers),
//! [`StridedConvert`] converts a tensor's elements to its destination dtype
//! (docs/quantization.md). Both address buffers by [`Loc`]: a byte offset in a tensor's view,
//! the staging arena or the conversion workspace.

use crate::quant::Arithmetic;

/// Which buffer an address is relative to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buffer {
    /// The source view of tensor `Loc::tensor` (the caller's `sendbuff`).
    Src,
    /// The destination view of tensor `Loc::tensor` (the caller's `recvbuff`).
    Dst,
    /// The rank's staging arena (`RankProgram::staging_bytes` long); `tensor` is unused.
    Staging,
    /// The rank's conversion workspace (`RankProgram::work_bytes` long; `tensor` is unused):
    /// tensors converted on the way are converted into it before the first round (by a
    /// sender) or received into it and converted after the last (by a receiver). Unlike
    /// staging, it keeps its contents for the whole call.
    Work,
}

/// A byte address: `offset` bytes into a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Which buffer.
    pub buffer: Buffer,
    /// The tensor whose view it is (a view buffer), or what the buffer's kind says.
    pub tensor: u32,
    /// Bytes from the buffer's start.
    pub offset: u64,
}

/// One axis of a strided copy: `count` steps of `src_stride` / `dst_stride` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyDim {
    /// Steps along the axis.
    pub count: u64,
    /// Bytes between steps on the source side.
    pub src_stride: u64,
    /// Bytes between steps on the destination side.
    pub dst_stride: u64,
}

/// A strided block copy: for every point of the `dims` grid (outermost first), copy
/// `chunk_bytes` contiguous bytes. Dims are normalised: no count-1 dims, adjacent dims merged
/// where both sides are contiguous across them, the innermost contiguous span folded into
/// `chunk_bytes`.
///
/// The byte form of every data movement in a plan: a [`Block`](super::Block)'s copy, a
/// [`Transfer`](super::Transfer)'s slice of it (the copy fields of `ncclReshardTransfer_t`),
/// and the program's local copies, packs and unpacks, which executors run as they are.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StridedCopy {
    /// Where the first byte is read.
    pub src: Loc,
    /// Where the first byte is written.
    pub dst: Loc,
    /// Contiguous bytes per grid point.
    pub chunk_bytes: u64,
    /// The grid, outermost axis first (empty: one chunk).
    pub dims: Vec<CopyDim>,
}

impl StridedCopy {
    /// Builds a normalised copy of `elem_size`-byte elements over `dims` (outermost first).
    pub fn new(src: Loc, dst: Loc, elem_size: u64, dims: &[CopyDim]) -> StridedCopy {
        if dims.iter().any(|d| d.count == 0) {
            return StridedCopy {
                src,
                dst,
                chunk_bytes: 0,
                dims: Vec::new(),
            };
        }
        // The innermost dims contiguous on both sides fold into the chunk (count-1 dims are
        // skipped wherever they are)…
        let mut chunk_bytes = elem_size;
        let mut end = dims.len();
        while let Some(inner) = end.checked_sub(1).map(|i| dims[i]) {
            if inner.count == 1 {
                end -= 1;
            } else if inner.src_stride == chunk_bytes && inner.dst_stride == chunk_bytes {
                chunk_bytes *= inner.count;
                end -= 1;
            } else {
                break;
            }
        }
        // …and adjacent dims contiguous across each other merge.
        let mut merged: Vec<CopyDim> = Vec::with_capacity(end);
        for &dim in dims[..end].iter().filter(|d| d.count != 1) {
            if let Some(inner) = merged.last_mut() {
                // `merged` holds outer dims; `dim` is the next inner one.
                if inner.src_stride == dim.src_stride * dim.count
                    && inner.dst_stride == dim.dst_stride * dim.count
                {
                    *inner = CopyDim {
                        count: inner.count * dim.count,
                        src_stride: dim.src_stride,
                        dst_stride: dim.dst_stride,
                    };
                    continue;
                }
            }
            merged.push(dim);
        }
        StridedCopy {
            src,
            dst,
            chunk_bytes,
            dims: merged,
        }
    }

    /// This copy for tensor `tensor` of the same class (tensors that share layouts, shape and
    /// dtype share their copies but for the tensor they name): the ends in a tensor's views
    /// name `tensor`; staging and workspace ends keep what their `tensor` field holds (a
    /// workspace region while blocks are formed).
    pub(crate) fn of_tensor(mut self, tensor: u32) -> StridedCopy {
        for end in [&mut self.src, &mut self.dst] {
            if matches!(end.buffer, Buffer::Src | Buffer::Dst) {
                end.tensor = tensor;
            }
        }
        self
    }

    /// Bytes this copy moves.
    pub fn bytes(&self) -> u64 {
        // Saturating: the planner's sizes are checked, but a malformed program handed to an
        // executor must fail its bounds checks, not overflow.
        self.dims
            .iter()
            .fold(self.chunk_bytes, |acc, d| acc.saturating_mul(d.count))
    }

    /// The copies that move bytes `[start, end)` of this copy, counted in its dense order
    /// (grid points row-major, `chunk_bytes` each): at most two per dim plus one. Cutting a
    /// copy into consecutive ranges and running the pieces moves exactly what it moves.
    pub fn slice(&self, start: u64, end: u64) -> Vec<StridedCopy> {
        let mut out = Vec::new();
        if start < end && end <= self.bytes() {
            slice_into(
                self.src,
                self.dst,
                self.chunk_bytes,
                &self.dims,
                start,
                end,
                &mut out,
            );
        }
        out
    }

    /// True when both sides are one contiguous range.
    pub fn is_contiguous(&self) -> bool {
        self.dims.is_empty()
    }

    /// True when the source side is one contiguous range.
    pub fn src_is_contiguous(&self) -> bool {
        self.side_is_contiguous(|d| d.src_stride)
    }

    /// True when the destination side is one contiguous range.
    pub fn dst_is_contiguous(&self) -> bool {
        self.side_is_contiguous(|d| d.dst_stride)
    }

    fn side_is_contiguous(&self, stride: impl Fn(&CopyDim) -> u64) -> bool {
        let mut run = self.chunk_bytes;
        for d in self.dims.iter().rev() {
            if stride(d) != run {
                return false;
            }
            run *= d.count;
        }
        true
    }

    /// One past the highest source byte touched, relative to its buffer.
    pub fn src_end(&self) -> u64 {
        self.src.offset.saturating_add(self.reach(|d| d.src_stride))
    }

    /// One past the highest destination byte touched, relative to its buffer.
    pub fn dst_end(&self) -> u64 {
        self.dst.offset.saturating_add(self.reach(|d| d.dst_stride))
    }

    fn reach(&self, stride: impl Fn(&CopyDim) -> u64) -> u64 {
        if self.bytes() == 0 {
            return 0;
        }
        self.dims.iter().fold(self.chunk_bytes, |acc, d| {
            acc.saturating_add((d.count - 1).saturating_mul(stride(d)))
        })
    }
}

fn shifted(loc: Loc, by: u64) -> Loc {
    Loc {
        offset: loc.offset + by,
        ..loc
    }
}

fn slice_into(
    src: Loc,
    dst: Loc,
    chunk_bytes: u64,
    dims: &[CopyDim],
    start: u64,
    end: u64,
    out: &mut Vec<StridedCopy>,
) {
    let Some((outer, inner)) = dims.split_first() else {
        out.push(StridedCopy::new(
            shifted(src, start),
            shifted(dst, start),
            end - start,
            &[],
        ));
        return;
    };
    let slab = inner.iter().fold(chunk_bytes, |acc, d| acc * d.count);
    let at = |i: u64| {
        (
            shifted(src, i * outer.src_stride),
            shifted(dst, i * outer.dst_stride),
        )
    };
    let (mut first, first_rest) = (start / slab, start % slab);
    let (last, last_rest) = (end / slab, end % slab);
    if first == last {
        let (s, d) = at(first);
        slice_into(s, d, chunk_bytes, inner, first_rest, last_rest, out);
        return;
    }
    if first_rest > 0 {
        let (s, d) = at(first);
        slice_into(s, d, chunk_bytes, inner, first_rest, slab, out);
        first += 1;
    }
    if last > first {
        let (s, d) = at(first);
        let mut whole = Vec::with_capacity(dims.len());
        whole.push(CopyDim {
            count: last - first,
            ..*outer
        });
        whole.extend_from_slice(inner);
        out.push(StridedCopy::new(s, d, chunk_bytes, &whole));
    }
    if last_rest > 0 {
        let (s, d) = at(last);
        slice_into(s, d, chunk_bytes, inner, 0, last_rest, out);
    }
}

/// One tensor dim of a [`StridedConvert`]: `count` elements, `src_stride` / `dst_stride`
/// bytes apart on each side, in quantization blocks of `block` elements (1 for a cast) whose
/// scales are `scale_stride` bytes apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvertDim {
    /// Elements along the dim.
    pub count: u64,
    /// Bytes between elements on the source side.
    pub src_stride: u64,
    /// Bytes between elements on the destination side.
    pub dst_stride: u64,
    /// Elements per quantization block along the dim.
    pub block: u64,
    /// Bytes between the scales of neighbouring blocks along the dim.
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
    /// The global index of the box's first element, per dim.
    pub start: Vec<u64>,
    /// Where the box's first element is read (in the source dtype).
    pub src: Loc,
    /// Where its first element is written (in the destination dtype).
    pub dst: Loc,
    /// Where the scales go (scaled conversions only).
    pub scale: Option<Loc>,
    /// The box, outermost dim first.
    pub dims: Vec<ConvertDim>,
    /// The dtypes and the scale encoding.
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
