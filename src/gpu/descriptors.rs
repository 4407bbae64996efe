//! The device encoding of copies and conversions: what `kernels/copy.cu` reads.
//!
//! Each `StridedCopy` of a program becomes one `CopyDesc` (same fields, fixed-size arrays) and a run
//! of `Tile`s that split its bytes into thread-block-sized pieces; copies are grouped into
//! launches whose base pointers fit in one kernel argument. Built once per plan and device,
//! uploaded once; a call only fills the base pointers. `tests/descriptors.rs` runs encodings
//! on the host with the kernel's index arithmetic, to check that they move the same bytes as
//! the host executor.
//!
//! Each `StridedConvert` becomes one `CopyDesc` in each of three passes ([`encode_converts`]):
//! the amax of every segment (a run of the box's innermost dim inside one block), the scale of
//! every block from its segments' amaxes, and the values. The passes are launched in order on
//! the stream, which is the only barrier the kernel needs; the amaxes and divisors live in a
//! scratch area of the call's staging allocation.

use crate::plan::{Buffer, Loc, StridedConvert, StridedCopy};
use crate::quant::ScaleFormat;

/// Must match `NCCL_RESHARD_MAX_COPY_DIMS` in kernels/copy.cu.
pub const MAX_COPY_DIMS: usize = 8;
/// Must match `NCCL_RESHARD_MAX_BASES` in kernels/copy.cu.
pub const MAX_BASES: usize = 384;
/// Bytes one thread block copies at most.
pub const TILE_BYTES: u64 = 256 << 10;
/// Conversion items (segments or blocks) one thread block handles: one per thread.
pub const TILE_ITEMS: u64 = 256;
/// Elements of one conversion segment at most (one thread reduces or converts them).
pub const SEGMENT_ELEMENTS: u64 = 1024;

/// `CopyDesc::kind` values; must match `NCCL_RESHARD_COPY` and `NCCL_RESHARD_CONVERT_*` in
/// kernels/copy.cu.
pub const KIND_COPY: u32 = 0;
pub const KIND_AMAX: u32 = 1;
pub const KIND_SCALE: u32 = 2;
pub const KIND_VALUES: u32 = 3;
/// `CopyDesc::arith` flags; must match `NCCL_RESHARD_ARITH_*` in kernels/copy.cu.
pub const ARITH_SCALED: u32 = 1 << 16;
pub const ARITH_E8M0: u32 = 1 << 17;
pub const ARITH_INVERSE: u32 = 1 << 18;

/// Mirrors `struct CopyDesc` in kernels/copy.cu (layout checked by a test).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyDesc {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub chunk_bytes: u64,
    pub src_base: u32,
    pub dst_base: u32,
    pub ndims: u32,
    pub kind: u32,
    pub count: [u64; MAX_COPY_DIMS],
    pub src_stride: [u64; MAX_COPY_DIMS],
    pub dst_stride: [u64; MAX_COPY_DIMS],
    pub block: [u64; MAX_COPY_DIMS],
    pub scale_stride: [u64; MAX_COPY_DIMS],
    pub scale_offset: u64,
    pub partials_offset: u64,
    pub divisors_offset: u64,
    pub segments_per_row: u64,
    pub segment: u64,
    pub scale_base: u32,
    pub work_base: u32,
    pub arith: u32,
    pub reserved: u32,
}

/// Mirrors `struct Tile` in kernels/copy.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tile {
    pub start: u64,
    pub bytes: u64,
    pub desc: u32,
    pub reserved: u32,
}

/// What a base pointer slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BaseKey {
    /// `sendbuff` of the single-buffer call.
    SendBuffer,
    /// `recvbuff` of the single-buffer call.
    RecvBuffer,
    /// `sendbuffs[t]` of the per-tensor call.
    SrcTensor(u32),
    /// `recvbuffs[t]` of the per-tensor call.
    DstTensor(u32),
    /// The plan's staging arena on this device.
    Staging,
    /// The call's conversion workspace (`Buffer::Work`).
    Work,
    /// The call's conversion scratch: segment amaxes and block divisors.
    Scratch,
}

/// How buffer locations become (base, offset): the single-buffer call bakes each tensor's view
/// offset into the descriptors; the per-tensor call gives every tensor its own base.
#[derive(Clone, Copy, Debug)]
pub enum Addressing<'a> {
    Single {
        src_offsets: &'a [u64],
        dst_offsets: &'a [u64],
    },
    PerTensor,
}

impl Addressing<'_> {
    /// The base slot and the offset from it of a program location.
    pub fn resolve(&self, loc: Loc) -> (BaseKey, u64) {
        match (self, loc.buffer) {
            (_, Buffer::Staging) => (BaseKey::Staging, loc.offset),
            (_, Buffer::Work) => (BaseKey::Work, loc.offset),
            (Addressing::Single { src_offsets, .. }, Buffer::Src) => (
                BaseKey::SendBuffer,
                src_offsets[loc.tensor as usize] + loc.offset,
            ),
            (Addressing::Single { dst_offsets, .. }, Buffer::Dst) => (
                BaseKey::RecvBuffer,
                dst_offsets[loc.tensor as usize] + loc.offset,
            ),
            (Addressing::PerTensor, Buffer::Src) => (BaseKey::SrcTensor(loc.tensor), loc.offset),
            (Addressing::PerTensor, Buffer::Dst) => (BaseKey::DstTensor(loc.tensor), loc.offset),
        }
    }
}

/// One kernel launch: `tiles` tiles starting at `first_tile`, with its base pointer slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub first_tile: u64,
    pub tiles: u64,
    pub bases: Vec<BaseKey>,
}

/// The encoding of a list of copies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    pub descs: Vec<CopyDesc>,
    pub tiles: Vec<Tile>,
    pub launches: Vec<Launch>,
}

impl Encoded {
    pub fn is_empty(&self) -> bool {
        self.tiles.is_empty()
    }
}

/// Encodes copies (in order) for the kernel.
pub fn encode(copies: &[StridedCopy], addressing: Addressing<'_>) -> Encoded {
    let mut assembler = Assembler::new();
    for copy in copies.iter().filter(|c| c.bytes() > 0) {
        let (src_key, src_offset) = addressing.resolve(copy.src);
        let (dst_key, dst_offset) = addressing.resolve(copy.dst);
        let mut desc = CopyDesc {
            src_offset,
            dst_offset,
            chunk_bytes: copy.chunk_bytes,
            ndims: copy.dims.len() as u32,
            ..Default::default()
        };
        for (k, dim) in copy.dims.iter().enumerate() {
            desc.count[k] = dim.count;
            desc.src_stride[k] = dim.src_stride;
            desc.dst_stride[k] = dim.dst_stride;
        }
        assembler.push(desc, &[src_key, dst_key], |tiles, index| {
            push_tiles(tiles, index, copy.chunk_bytes, copy.bytes())
        });
    }
    assembler.finish()
}

/// The three passes of a list of conversions (amaxes, scales, values, launched in that
/// order) and the scratch bytes they address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConvertPasses {
    pub passes: [Encoded; 3],
    pub scratch_bytes: u64,
}

impl ConvertPasses {
    pub fn is_empty(&self) -> bool {
        self.passes.iter().all(Encoded::is_empty)
    }
}

/// Launches being assembled: descriptors go to the open launch while their base slots fit.
struct Assembler {
    out: Encoded,
    launch: Option<Launch>,
}

impl Assembler {
    fn new() -> Self {
        Assembler {
            out: Encoded::default(),
            launch: None,
        }
    }

    /// Adds a descriptor whose base slots are `keys` (source, destination, then for a
    /// conversion scales and scratch), starting a new launch when they do not fit the open
    /// one, and its tiles (`tiles` appends them given the descriptor's index).
    fn push(
        &mut self,
        mut desc: CopyDesc,
        keys: &[BaseKey],
        tiles: impl FnOnce(&mut Vec<Tile>, u32),
    ) {
        let fits = |l: &Launch| {
            let mut new: Vec<&BaseKey> = keys.iter().filter(|k| !l.bases.contains(k)).collect();
            new.dedup();
            l.bases.len() + new.len() <= MAX_BASES
        };
        if !self.launch.as_ref().is_some_and(fits) {
            if let Some(done) = self.launch.take() {
                self.out.launches.push(done);
            }
            self.launch = Some(Launch {
                first_tile: self.out.tiles.len() as u64,
                tiles: 0,
                bases: Vec::new(),
            });
        }
        let launch = self.launch.as_mut().expect("a launch is open");
        let mut slot = |key: BaseKey| -> u32 {
            match launch.bases.iter().position(|&k| k == key) {
                Some(i) => i as u32,
                None => {
                    launch.bases.push(key);
                    (launch.bases.len() - 1) as u32
                }
            }
        };
        let slots: Vec<u32> = keys.iter().map(|&k| slot(k)).collect();
        desc.src_base = slots[0];
        desc.dst_base = slots[1];
        if slots.len() > 3 {
            desc.scale_base = slots[2];
            desc.work_base = slots[3];
        }
        let index = self.out.descs.len() as u32;
        self.out.descs.push(desc);
        let before = self.out.tiles.len();
        tiles(&mut self.out.tiles, index);
        launch.tiles += (self.out.tiles.len() - before) as u64;
    }

    fn finish(mut self) -> Encoded {
        if let Some(done) = self.launch.take() {
            self.out.launches.push(done);
        }
        self.out
    }
}

/// How the kernel cuts one conversion's box: blocks per dim (a cast has none: one "block" per
/// box makes long segments), segments of at most [`SEGMENT_ELEMENTS`] inside a block's last
/// dim, and the items each pass tiles (segments, blocks). Sizes saturate: a box too large for
/// them is refused by [`convert_tables`]' bound before anything is encoded.
struct ConvertShape {
    block: [u64; MAX_COPY_DIMS],
    segment: u64,
    segments_per_row: u64,
    segments: u64,
    blocks: u64,
}

impl ConvertShape {
    fn of(convert: &StridedConvert, scaled: bool) -> ConvertShape {
        // A 0-d tensor's box is one element: one dim of count 1.
        let n = convert.dims.len().max(1);
        let mut block = [1u64; MAX_COPY_DIMS];
        for (k, dim) in convert.dims.iter().enumerate() {
            block[k] = if scaled {
                dim.block.max(1)
            } else {
                dim.count.max(1)
            };
        }
        let count = |k: usize| convert.dims.get(k).map_or(1, |d| d.count);
        let last = n - 1;
        let segment = block[last].min(SEGMENT_ELEMENTS);
        let per_block = block[last].div_ceil(segment);
        let segments_per_row = count(last).div_ceil(block[last]).saturating_mul(per_block);
        let rows = (0..last).fold(1u64, |acc, k| acc.saturating_mul(count(k)));
        let blocks = (0..n).fold(1u64, |acc, k| {
            acc.saturating_mul(count(k).div_ceil(block[k]))
        });
        ConvertShape {
            block,
            segment,
            segments_per_row,
            segments: rows.saturating_mul(segments_per_row),
            blocks,
        }
    }
}

/// What a rank's conversions need on the device, without encoding them: (scratch bytes, tiles
/// over the three passes). Plan creation bounds the tiles ([`MAX_CONVERT_TILES`]).
pub fn convert_tables(converts: &[StridedConvert]) -> (u64, u64) {
    let (mut scratch, mut tiles) = (0u64, 0u64);
    for convert in converts.iter().filter(|c| c.elements() > 0) {
        let scaled = convert.scale.is_some() && convert.arithmetic.scale.is_some();
        let shape = ConvertShape::of(convert, scaled);
        let per_pass = shape.segments.div_ceil(TILE_ITEMS);
        tiles = tiles.saturating_add(per_pass);
        if scaled {
            scratch = scratch.saturating_add(
                shape
                    .segments
                    .saturating_add(shape.blocks)
                    .saturating_mul(4),
            );
            tiles = tiles
                .saturating_add(per_pass)
                .saturating_add(shape.blocks.div_ceil(TILE_ITEMS));
        }
    }
    (scratch, tiles)
}

/// Most tiles a rank's conversions (before or after the rounds) may take: 2^24 tiles of 32
/// bytes, 512 MiB of descriptor table, 2^32 segments (a Kimi-K2 inference rank quantizing
/// its 65 G elements in 128 × 128 blocks needs about 4 M tiles).
pub const MAX_CONVERT_TILES: u64 = 1 << 24;

/// Encodes conversions (in order) for the kernel's three passes.
pub fn encode_converts(converts: &[StridedConvert], addressing: Addressing<'_>) -> ConvertPasses {
    let mut passes = [Assembler::new(), Assembler::new(), Assembler::new()];
    let mut scratch = 0u64;
    for convert in converts.iter().filter(|c| c.elements() > 0) {
        let (src_key, src_offset) = addressing.resolve(convert.src);
        let (dst_key, dst_offset) = addressing.resolve(convert.dst);
        let scaled = convert.scale.is_some() && convert.arithmetic.scale.is_some();
        let (scale_key, scale_offset) = match convert.scale {
            Some(loc) if scaled => addressing.resolve(loc),
            _ => (dst_key, 0),
        };
        let n = convert.dims.len();
        let mut desc = CopyDesc {
            src_offset,
            dst_offset,
            ndims: n as u32,
            scale_offset,
            arith: convert.arithmetic.src.nccl_code() as u32
                | (convert.arithmetic.dst.nccl_code() as u32) << 8,
            ..Default::default()
        };
        if let Some(encoding) = convert.arithmetic.scale.filter(|_| scaled) {
            desc.arith |= ARITH_SCALED;
            if encoding.format == ScaleFormat::E8m0 {
                desc.arith |= ARITH_E8M0;
            }
            if encoding.inverse {
                desc.arith |= ARITH_INVERSE;
            }
        }
        let shape = ConvertShape::of(convert, scaled);
        if n == 0 {
            // A 0-d tensor's one element, as one dim of count 1.
            desc.ndims = 1;
            desc.count[0] = 1;
            desc.block[0] = 1;
        }
        for (k, dim) in convert.dims.iter().enumerate() {
            desc.count[k] = dim.count;
            desc.src_stride[k] = dim.src_stride;
            desc.dst_stride[k] = dim.dst_stride;
            desc.block[k] = shape.block[k];
            desc.scale_stride[k] = dim.scale_stride;
        }
        desc.segment = shape.segment;
        desc.segments_per_row = shape.segments_per_row;
        let (segments, blocks) = (shape.segments, shape.blocks);
        desc.partials_offset = scratch;
        desc.divisors_offset = scratch + 4 * segments;
        if scaled {
            scratch += 4 * (segments + blocks);
        }
        let keys = [src_key, dst_key, scale_key, BaseKey::Scratch];
        if scaled {
            passes[0].push(
                CopyDesc {
                    kind: KIND_AMAX,
                    ..desc
                },
                &keys,
                |tiles, index| push_items(tiles, index, segments),
            );
            passes[1].push(
                CopyDesc {
                    kind: KIND_SCALE,
                    ..desc
                },
                &keys,
                |tiles, index| push_items(tiles, index, blocks),
            );
        }
        passes[2].push(
            CopyDesc {
                kind: KIND_VALUES,
                ..desc
            },
            &keys,
            |tiles, index| push_items(tiles, index, segments),
        );
    }
    let [a, b, c] = passes;
    ConvertPasses {
        passes: [a.finish(), b.finish(), c.finish()],
        scratch_bytes: scratch,
    }
}

/// Tiles of one conversion pass: [`TILE_ITEMS`] items each.
fn push_items(tiles: &mut Vec<Tile>, desc: u32, items: u64) {
    let mut at = 0;
    while at < items {
        let n = TILE_ITEMS.min(items - at);
        tiles.push(Tile {
            start: at,
            bytes: n,
            desc,
            reserved: 0,
        });
        at += n;
    }
}

/// Tiles of one descriptor: inside a chunk when chunks are large, whole chunks otherwise.
fn push_tiles(tiles: &mut Vec<Tile>, desc: u32, chunk_bytes: u64, total: u64) {
    if chunk_bytes >= TILE_BYTES {
        let chunks = total / chunk_bytes;
        for c in 0..chunks {
            let mut at = 0;
            while at < chunk_bytes {
                let bytes = TILE_BYTES.min(chunk_bytes - at);
                tiles.push(Tile {
                    start: c * chunk_bytes + at,
                    bytes,
                    desc,
                    reserved: 0,
                });
                at += bytes;
            }
        }
    } else {
        let step = (TILE_BYTES / chunk_bytes) * chunk_bytes;
        let mut at = 0;
        while at < total {
            let bytes = step.min(total - at);
            tiles.push(Tile {
                start: at,
                bytes,
                desc,
                reserved: 0,
            });
            at += bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::CopyDim;

    #[test]
    fn struct_layouts_match_the_kernel() {
        // 3 u64 + 4 u32 + 5 arrays of 8 u64 + 5 u64 + 4 u32; 2 u64 + 2 u32.
        assert_eq!(std::mem::size_of::<CopyDesc>(), 24 + 16 + 5 * 64 + 40 + 16);
        assert_eq!(std::mem::size_of::<Tile>(), 24);
        assert_eq!(std::mem::align_of::<CopyDesc>(), 8);
    }

    #[test]
    fn tiles_cover_every_byte_once() {
        for (chunk, count) in [
            (1u64, 1_000_000u64),
            (100, 7),
            (TILE_BYTES, 3),
            (TILE_BYTES * 2 + 5, 2),
        ] {
            let copy = StridedCopy::new(
                Loc {
                    buffer: Buffer::Src,
                    tensor: 0,
                    offset: 0,
                },
                Loc {
                    buffer: Buffer::Staging,
                    tensor: 0,
                    offset: 0,
                },
                chunk,
                &[CopyDim {
                    count,
                    src_stride: chunk * 2,
                    dst_stride: chunk,
                }],
            );
            let e = encode(std::slice::from_ref(&copy), Addressing::PerTensor);
            let mut at = 0;
            for t in &e.tiles {
                assert_eq!(t.start, at);
                assert!(t.bytes <= TILE_BYTES.max(chunk));
                let inside = t.start / chunk == (t.start + t.bytes - 1) / chunk;
                assert!(inside || (t.start % chunk == 0 && t.bytes % chunk == 0));
                at += t.bytes;
            }
            assert_eq!(at, copy.bytes());
        }
    }

    #[test]
    fn launches_split_when_bases_run_out() {
        let copies: Vec<StridedCopy> = (0..1000u32)
            .map(|t| {
                StridedCopy::new(
                    Loc {
                        buffer: Buffer::Src,
                        tensor: t,
                        offset: 0,
                    },
                    Loc {
                        buffer: Buffer::Dst,
                        tensor: t,
                        offset: 0,
                    },
                    4,
                    &[],
                )
            })
            .collect();
        let e = encode(&copies, Addressing::PerTensor);
        assert!(e.launches.len() >= 1000 * 2 / MAX_BASES);
        assert!(e.launches.iter().all(|l| l.bases.len() <= MAX_BASES));
        assert_eq!(e.launches.iter().map(|l| l.tiles).sum::<u64>(), 1000);
        let single = encode(
            &copies,
            Addressing::Single {
                src_offsets: &[0; 1000],
                dst_offsets: &[0; 1000],
            },
        );
        assert_eq!(single.launches.len(), 1);
        assert_eq!(
            single.launches[0].bases,
            [BaseKey::SendBuffer, BaseKey::RecvBuffer]
        );
    }
}
