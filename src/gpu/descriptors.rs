//! The device encoding of copies and conversions: what `kernels/copy.cu` reads.
//!
//! Each `StridedCopy` of a program becomes one `CopyDesc` (same fields, fixed-size arrays) and a run
//! of `Tile`s that split its bytes into pieces of at most [`TILE_BYTES`] (the kernel's blocks
//! walk them grid-stride); copies are grouped into launches whose base pointers fit in one
//! kernel argument. Built once per plan and device, uploaded once; a call only fills the base
//! pointers. `tests/descriptors.rs` runs encodings on the host with the kernel's index
//! arithmetic, to check that they move the same bytes as the host executor.
//!
//! Each `StridedConvert` becomes one `CopyDesc` in each of its passes ([`encode_converts`]):
//! partial amaxes (an item: up to 64 rows of one 16-byte strip, or up to 16 strips of a row,
//! inside one block), reductions of [`FANIN`] partials into one while a block has more, every
//! block's scale, and the values (the amax items again). The passes are launched in order on
//! the stream, which is the only barrier the kernel needs; the partials and divisors live in a
//! scratch area of the call's staging allocation.

use crate::plan::{Buffer, Loc, StridedConvert, StridedCopy};
use crate::quant::ScaleFormat;

/// Must match `NCCL_RESHARD_MAX_COPY_DIMS` in kernels/copy.cu.
pub const MAX_COPY_DIMS: usize = 8;
/// Must match `NCCL_RESHARD_MAX_BASES` in kernels/copy.cu.
pub const MAX_BASES: usize = 384;
/// Bytes of one tile at most: the unit a thread block takes at a time (the kernel's blocks walk
/// a launch's tiles grid-stride). Small enough that a launch of a few MB still spreads over
/// every block of the grid; the kernel keeps a tile's rows, lengths and items in 32 bits.
pub const TILE_BYTES: u64 = 64 << 10;
/// Conversion items one tile holds: one per thread.
pub const TILE_ITEMS: u64 = 256;
/// Partials one reduction item folds into one; must match `NCCL_RESHARD_FANIN`.
pub const FANIN: u64 = 64;

/// `CopyDesc::kind` values; must match `NCCL_RESHARD_COPY` and `NCCL_RESHARD_CONVERT_*` in
/// kernels/copy.cu.
pub const KIND_COPY: u32 = 0;
pub const KIND_AMAX: u32 = 1;
pub const KIND_SCALE: u32 = 2;
pub const KIND_VALUES: u32 = 3;
pub const KIND_REDUCE: u32 = 4;
/// `CopyDesc::row_dim` when no outer dim varies inside a block or several do; must match
/// `NCCL_RESHARD_ROWS_*`.
pub const ROWS_ONE: u32 = 0xffff_fffe;
pub const ROWS_GENERAL: u32 = 0xffff_ffff;
/// `CopyDesc::arith` flags; must match `NCCL_RESHARD_ARITH_*` in kernels/copy.cu.
pub const ARITH_SCALED: u32 = 1 << 16;
pub const ARITH_E8M0: u32 = 1 << 17;
pub const ARITH_INVERSE: u32 = 1 << 18;

/// Mirrors `struct CopyDesc` in kernels/copy.cu (layout checked by a test). The conversion
/// fields are [`ConvertShape`]'s.
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
    pub blocks: u64,
    pub partials: u64,
    pub strip_groups: u64,
    pub row_chunks: u64,
    pub item_rows: u32,
    pub item_strips: u32,
    pub row_dim: u32,
    pub level: u32,
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

/// One kernel launch: `tiles` tiles starting at `first_tile`, with its base pointer slots (the
/// grid is capped at launch: its blocks walk the tiles grid-stride).
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

/// The passes of a list of conversions, launched in this order: partial amaxes, one
/// reduction pass per level the deepest conversion needs, scales, values; and the scratch
/// bytes they address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConvertPasses {
    pub passes: Vec<Encoded>,
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

/// One dim of a conversion's box as the kernel sees it: [`ConvertShape`] merges dims a block
/// spans whole into the dim outside them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BoxDim {
    count: u64,
    src_stride: u64,
    dst_stride: u64,
    block: u64,
    scale_stride: u64,
}

/// How the kernel cuts one conversion's box (the fields of its `CopyDesc`s). A block's rows
/// are its index points along the outer dims; a strip is 16 bytes of source (4 FP32 or 8
/// 16-bit elements) of one row inside one block. An item of the amax and values passes is
/// `item_strips` strips (`strip_groups` apart, so that adjacent items read adjacent 16-byte
/// words) of `item_rows` rows: at least four 16-byte loads, which one thread keeps in flight,
/// and few enough partials per block (`partials`, at most [`FANIN`] where the block allows)
/// that its scale needs no reduction pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvertShape {
    dims: Vec<BoxDim>,
    blocks: u64,
    item_rows: u64,
    item_strips: u64,
    strip_groups: u64,
    row_chunks: u64,
    partials: u64,
    row_dim: u32,
    /// Partials per block after each reduction pass (empty: the scale pass folds the items').
    levels: Vec<u64>,
}

impl ConvertShape {
    fn of(convert: &StridedConvert, scaled: bool) -> ConvertShape {
        // A 0-d tensor's box is one element: one dim of count 1. A cast is one "block" per box.
        let mut dims: Vec<BoxDim> = convert
            .dims
            .iter()
            .map(|d| BoxDim {
                count: d.count,
                src_stride: d.src_stride,
                dst_stride: d.dst_stride,
                block: if scaled {
                    d.block.max(1)
                } else {
                    d.count.max(1)
                },
                scale_stride: d.scale_stride,
            })
            .collect();
        if dims.is_empty() {
            dims.push(BoxDim {
                count: 1,
                src_stride: 0,
                dst_stride: 0,
                block: 1,
                scale_stride: 0,
            });
        }
        // Outer dims of one element carry nothing; an outer dim a block spans whole merges into
        // the one outside it when both sides are contiguous across them (rows of a dense
        // per-tensor or cast box become one dim), so most blocks vary along one dim.
        let inner = dims.pop().expect("a box has a dim");
        let mut outer: Vec<BoxDim> = Vec::with_capacity(dims.len());
        for dim in dims.into_iter().filter(|d| d.count != 1) {
            if let Some(prev) = outer.last_mut() {
                let merged = (dim.block >= dim.count)
                    .then(|| {
                        Some(BoxDim {
                            count: prev.count.checked_mul(dim.count)?,
                            src_stride: dim.src_stride,
                            dst_stride: dim.dst_stride,
                            block: prev.block.checked_mul(dim.count)?,
                            scale_stride: prev.scale_stride,
                        })
                    })
                    .flatten()
                    .filter(|_| {
                        dim.src_stride.checked_mul(dim.count) == Some(prev.src_stride)
                            && dim.dst_stride.checked_mul(dim.count) == Some(prev.dst_stride)
                    });
                if let Some(merged) = merged {
                    *prev = merged;
                    continue;
                }
            }
            outer.push(dim);
        }
        let varying: Vec<usize> = (0..outer.len())
            .filter(|&k| outer[k].block.min(outer[k].count) > 1)
            .collect();
        let row_dim = match varying[..] {
            [] => ROWS_ONE,
            [k] => k as u32,
            _ => ROWS_GENERAL,
        };
        let rows = outer.iter().fold(1u64, |acc, d| {
            acc.saturating_mul(d.block.min(d.count).max(1))
        });
        outer.push(inner);
        let dims = outer;
        let blocks = dims
            .iter()
            .fold(1u64, |acc, d| acc.saturating_mul(d.count.div_ceil(d.block)));
        let per_strip = 16 / u64::from(convert.arithmetic.src.size());
        let strips = inner.block.min(inner.count).max(1).div_ceil(per_strip);
        let (item_rows, item_strips) = if rows >= 4 {
            let wanted = rows.saturating_mul(strips).div_ceil(FANIN);
            (rows.min(wanted.next_power_of_two().clamp(16, 64)), 1)
        } else {
            let wanted = strips.div_ceil(FANIN).next_power_of_two().clamp(4, 16);
            (rows, strips.min(wanted))
        };
        let strip_groups = strips.div_ceil(item_strips);
        let row_chunks = rows.div_ceil(item_rows);
        let partials = strip_groups.saturating_mul(row_chunks);
        let mut levels = Vec::new();
        let mut p = partials;
        while scaled && p > FANIN {
            p = p.div_ceil(FANIN);
            levels.push(p);
        }
        ConvertShape {
            dims,
            blocks,
            item_rows,
            item_strips,
            strip_groups,
            row_chunks,
            partials,
            row_dim,
            levels,
        }
    }

    /// Items of the amax and values passes.
    fn items(&self) -> u64 {
        self.blocks.saturating_mul(self.partials)
    }

    /// Scratch bytes from a 16-byte aligned start: the blocks' divisors, then each level of
    /// partials 16-byte aligned (as `partials_level` in kernels/copy.cu places them). Returns
    /// (divisors, level 0's partials, bytes in all).
    fn scratch(&self) -> (u64, u64, u64) {
        let round = |x: u64| x.saturating_add(15) & !15;
        let partials = round(self.blocks.saturating_mul(4));
        let mut end = partials;
        for p in std::iter::once(self.partials).chain(self.levels.iter().copied()) {
            end = round(end.saturating_add(self.blocks.saturating_mul(p).saturating_mul(4)));
        }
        (0, partials, end)
    }

    /// Tiles of each pass: amax, reductions, scale (scaled conversions), values.
    fn tiles(&self, scaled: bool) -> u64 {
        let tiles = |items: u64| items.div_ceil(TILE_ITEMS);
        let mut n = tiles(self.items());
        if scaled {
            n = n
                .saturating_add(tiles(self.items()))
                .saturating_add(tiles(self.blocks));
            for &p in &self.levels {
                n = n.saturating_add(tiles(self.blocks.saturating_mul(p)));
            }
        }
        n
    }
}

/// What a rank's conversions need on the device, without encoding them: (scratch bytes, tiles
/// over all passes). Plan creation bounds the tiles ([`MAX_CONVERT_TILES`]).
pub fn convert_tables(converts: &[StridedConvert]) -> (u64, u64) {
    let (mut scratch, mut tiles) = (0u64, 0u64);
    for convert in converts.iter().filter(|c| c.elements() > 0) {
        let scaled = convert.scale.is_some() && convert.arithmetic.scale.is_some();
        let shape = ConvertShape::of(convert, scaled);
        tiles = tiles.saturating_add(shape.tiles(scaled));
        if scaled {
            scratch = scratch.saturating_add(shape.scratch().2);
        }
    }
    (scratch, tiles)
}

/// Most tiles a rank's conversions (before or after the rounds) may take: 2^24 tiles of 24
/// bytes, 384 MiB of tile table. A conversion item reads at least 64 bytes and usually 512
/// (128 x 128 blocks of bfloat16: 32 rows of one 16-byte strip), so the bound is 2^32 items,
/// 2^35 elements in 128 x 128 blocks (a Kimi-K2 inference rank quantizing its 65 G elements
/// needs about 2 M tiles).
pub const MAX_CONVERT_TILES: u64 = 1 << 24;

/// Encodes conversions (in order) for the kernel's passes.
pub fn encode_converts(converts: &[StridedConvert], addressing: Addressing<'_>) -> ConvertPasses {
    let live: Vec<(&StridedConvert, bool, ConvertShape)> = converts
        .iter()
        .filter(|c| c.elements() > 0)
        .map(|c| {
            let scaled = c.scale.is_some() && c.arithmetic.scale.is_some();
            (c, scaled, ConvertShape::of(c, scaled))
        })
        .collect();
    let depth = live
        .iter()
        .map(|(_, _, s)| s.levels.len())
        .max()
        .unwrap_or(0);
    // [amax, reduce 1..=depth, scale, values]
    let mut passes: Vec<Assembler> = (0..depth + 3).map(|_| Assembler::new()).collect();
    let mut scratch = 0u64;
    for (convert, scaled, shape) in live {
        let (src_key, src_offset) = addressing.resolve(convert.src);
        let (dst_key, dst_offset) = addressing.resolve(convert.dst);
        let (scale_key, scale_offset) = match convert.scale {
            Some(loc) if scaled => addressing.resolve(loc),
            _ => (dst_key, 0),
        };
        let (divisors, partials, bytes) = shape.scratch();
        let mut desc = CopyDesc {
            src_offset,
            dst_offset,
            ndims: shape.dims.len() as u32,
            scale_offset,
            arith: convert.arithmetic.src.nccl_code() as u32
                | (convert.arithmetic.dst.nccl_code() as u32) << 8,
            divisors_offset: scratch + divisors,
            partials_offset: scratch + partials,
            blocks: shape.blocks,
            partials: shape.partials,
            strip_groups: shape.strip_groups,
            row_chunks: shape.row_chunks,
            item_rows: shape.item_rows as u32,
            item_strips: shape.item_strips as u32,
            row_dim: shape.row_dim,
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
        for (k, dim) in shape.dims.iter().enumerate() {
            desc.count[k] = dim.count;
            desc.src_stride[k] = dim.src_stride;
            desc.dst_stride[k] = dim.dst_stride;
            desc.block[k] = dim.block;
            desc.scale_stride[k] = dim.scale_stride;
        }
        if scaled {
            scratch += bytes;
        }
        let keys = [src_key, dst_key, scale_key, BaseKey::Scratch];
        let items = shape.items();
        // (pass, kind, level, items) of each pass this conversion takes part in.
        let mut steps: Vec<(usize, u32, u32, u64)> = Vec::with_capacity(shape.levels.len() + 3);
        if scaled {
            steps.push((0, KIND_AMAX, 0, items));
            for (l, &p) in shape.levels.iter().enumerate() {
                steps.push((1 + l, KIND_REDUCE, l as u32 + 1, shape.blocks * p));
            }
            steps.push((depth + 1, KIND_SCALE, 0, shape.blocks));
        }
        steps.push((depth + 2, KIND_VALUES, 0, items));
        for (pass, kind, level, n) in steps {
            let mut step = desc;
            step.kind = kind;
            step.level = level;
            passes[pass].push(step, &keys, |tiles, index| push_items(tiles, index, n));
        }
    }
    ConvertPasses {
        passes: passes.into_iter().map(Assembler::finish).collect(),
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
        // 3 u64 + 4 u32 + 5 arrays of 8 u64 + 7 u64 + 8 u32; 2 u64 + 2 u32.
        assert_eq!(std::mem::size_of::<CopyDesc>(), 24 + 16 + 5 * 64 + 56 + 32);
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
