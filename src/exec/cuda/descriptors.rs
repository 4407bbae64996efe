//! The device encoding of copies: what `kernels/copy.cu` reads.
//!
//! Each `StridedCopy` of a program becomes one `CopyDesc` (same fields, fixed-size arrays) and a run
//! of `Tile`s that split its bytes into thread-block-sized pieces; copies are grouped into
//! launches whose base pointers fit in one kernel argument. Built once per plan and device,
//! uploaded once; a call only fills the base pointers. `tests/descriptors.rs` runs encodings
//! on the host with the kernel's index arithmetic, to check that they move the same bytes as
//! the host executor.

use crate::plan::{Buffer, Loc, StridedCopy};

/// Must match `NCCL_RESHARD_MAX_COPY_DIMS` in kernels/copy.cu.
pub const MAX_COPY_DIMS: usize = 8;
/// Must match `NCCL_RESHARD_MAX_BASES` in kernels/copy.cu.
pub const MAX_BASES: usize = 384;
/// Bytes one thread block copies at most.
pub const TILE_BYTES: u64 = 256 << 10;

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
    pub reserved: u32,
    pub count: [u64; MAX_COPY_DIMS],
    pub src_stride: [u64; MAX_COPY_DIMS],
    pub dst_stride: [u64; MAX_COPY_DIMS],
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
    let mut out = Encoded::default();
    let mut launch: Option<Launch> = None;
    for copy in copies.iter().filter(|c| c.bytes() > 0) {
        let (src_key, src_offset) = addressing.resolve(copy.src);
        let (dst_key, dst_offset) = addressing.resolve(copy.dst);
        // Start a new launch when this copy's bases would not fit the current one.
        let fits = |l: &Launch| {
            let new = [src_key, dst_key]
                .iter()
                .filter(|k| !l.bases.contains(k))
                .count();
            l.bases.len() + new <= MAX_BASES
        };
        if !launch.as_ref().is_some_and(fits) {
            if let Some(done) = launch.take() {
                out.launches.push(done);
            }
            launch = Some(Launch {
                first_tile: out.tiles.len() as u64,
                tiles: 0,
                bases: Vec::new(),
            });
        }
        let current = launch.as_mut().expect("a launch is open");
        let slot = |l: &mut Launch, key: BaseKey| -> u32 {
            match l.bases.iter().position(|&k| k == key) {
                Some(i) => i as u32,
                None => {
                    l.bases.push(key);
                    (l.bases.len() - 1) as u32
                }
            }
        };
        let mut desc = CopyDesc {
            src_offset,
            dst_offset,
            chunk_bytes: copy.chunk_bytes,
            src_base: slot(current, src_key),
            dst_base: slot(current, dst_key),
            ndims: copy.dims.len() as u32,
            ..Default::default()
        };
        for (k, dim) in copy.dims.iter().enumerate() {
            desc.count[k] = dim.count;
            desc.src_stride[k] = dim.src_stride;
            desc.dst_stride[k] = dim.dst_stride;
        }
        let index = out.descs.len() as u32;
        out.descs.push(desc);
        let before = out.tiles.len();
        push_tiles(&mut out.tiles, index, copy.chunk_bytes, copy.bytes());
        current.tiles += (out.tiles.len() - before) as u64;
    }
    if let Some(done) = launch {
        out.launches.push(done);
    }
    out
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
        // 3 u64 + 4 u32 + 3 arrays of 8 u64; 2 u64 + 2 u32.
        assert_eq!(std::mem::size_of::<CopyDesc>(), 24 + 16 + 3 * 64);
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
