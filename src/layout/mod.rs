//! Layouts: global shape + mesh + one placement per mesh axis → each rank's local indices,
//! exactly as PyTorch DTensor computes them (docs/design.md §2).
//!
//! A rank's local tensor is the Cartesian product of its per-dim index sets. Along a dim, the
//! set starts as `0..n` and every mesh axis whose placement shards that dim, taken left to
//! right, cuts the current list with torch's chunk rule (`Shard`) or its strided variant
//! (`_StridedShard`). Replicated axes do not change it.

mod dtype;
mod mesh;
mod runs;

pub use dtype::DType;
pub use mesh::{Mesh, MAX_MESH_AXES, MAX_MESH_RANKS};
pub use runs::{chunk_bounds, IndexRuns, Run};

use crate::error::{checked_add, checked_mul, Error, Result};
use std::fmt;

/// The most dimensions a tensor may have.
pub const MAX_TENSOR_DIMS: usize = 8;
/// The most pieces the StridedShard placements on one dim may cut it into (the product of
/// their split factors, each capped by the dim's size); real FSDP2 + TP layouts use the TP
/// size, a few dozen at most.
pub const MAX_SPLIT_PRODUCT: u64 = 1 << 16;

/// How a tensor is placed along one mesh axis (torch's `Placement`s; `Partial` is out of
/// scope).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// torch `Replicate()`: every coordinate along the axis holds the same indices; the axis
    /// cuts no dim.
    Replicate,
    /// torch `Shard(dim)`: the axis cuts tensor dim `dim` by torch.chunk's rule, so trailing
    /// shards are short or empty ([`chunk_bounds`]).
    Shard(usize),
    /// torch `_StridedShard(dim, split_factor)`: the FSDP2 + TP right-to-left sharding.
    StridedShard {
        /// The tensor dim the axis cuts.
        dim: usize,
        /// How many pieces the dim's current list is chunked into before each piece is cut
        /// across the axis; at least 1 ([`Layout::validate`] checks).
        split_factor: u64,
    },
    /// The axis cuts tensor dim `dim` into blocks of `block` indices: coordinate `c` holds
    /// positions `[c·block, (c+1)·block)` of the current list, clipped to it, so trailing
    /// coordinates hold short or empty blocks. Not a torch placement: what engines shard that
    /// way need it (vLLM's vocab-parallel embedding and LM head: blocks of `Vp / tp` rows of the
    /// vocabulary padded to `Vp`; Megatron's likewise), where torch.chunk would cut elsewhere.
    ShardBlocks {
        /// The tensor dim the axis cuts.
        dim: usize,
        /// Indices per block; at least 1 ([`Layout::validate`] checks).
        block: u64,
    },
}

impl Placement {
    /// The tensor dim this placement shards, if any.
    pub fn dim(&self) -> Option<usize> {
        match *self {
            Placement::Replicate => None,
            Placement::Shard(dim)
            | Placement::StridedShard { dim, .. }
            | Placement::ShardBlocks { dim, .. } => Some(dim),
        }
    }

    /// Parses `Replicate`, `R`, `Shard(0)`, `S(0)`, `Shard(dim=0)`, `StridedShard(0,2)`,
    /// `_StridedShard(dim=0, split_factor=2)`, `ShardBlocks(0,288)`, `ShardBlocks(dim=0,
    /// block=288)`.
    pub fn parse(text: &str) -> Result<Placement> {
        let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        let bad = || {
            Error::invalid_argument(format!(
                "placement {text:?} is not one of Replicate, Shard(d), StridedShard(d,split_factor), ShardBlocks(d,block)"
            ))
        };
        if matches!(compact.as_str(), "Replicate" | "Replicate()" | "R") {
            return Ok(Placement::Replicate);
        }
        if compact.starts_with("Partial") || compact == "P" {
            return Err(Error::invalid_argument(format!(
                "placement {text:?}: Partial is not supported; reduce the tensor before resharding"
            )));
        }
        let (name, rest) = compact.split_once('(').ok_or_else(bad)?;
        let args = rest.strip_suffix(')').ok_or_else(bad)?;
        let keywords: &[&str] = match name {
            "Shard" | "S" => &["dim"],
            "StridedShard" | "_StridedShard" | "_S" => &["dim", "split_factor"],
            "ShardBlocks" => &["dim", "block"],
            _ => return Err(bad()),
        };
        // Arguments by position, then by torch's keyword names in any order; each once.
        let mut values: Vec<Option<u64>> = vec![None; keywords.len()];
        let (mut positional, mut keyword_seen) = (0, false);
        for arg in args.split(',') {
            let (slot, value) = match arg.split_once('=') {
                Some((key, value)) => {
                    keyword_seen = true;
                    (keywords.iter().position(|k| *k == key), value)
                }
                None if keyword_seen => (None, arg),
                None => {
                    positional += 1;
                    (Some(positional - 1), arg)
                }
            };
            let slot = slot
                .filter(|&i| values.get(i) == Some(&None))
                .ok_or_else(bad)?;
            values[slot] = Some(value.parse::<u64>().map_err(|_| bad())?);
        }
        match (name, values.as_slice()) {
            ("Shard" | "S", &[Some(dim)]) => Ok(Placement::Shard(dim as usize)),
            ("ShardBlocks", &[Some(dim), Some(block)]) => Ok(Placement::ShardBlocks {
                dim: dim as usize,
                block,
            }),
            (_, &[Some(dim), Some(split_factor)]) => Ok(Placement::StridedShard {
                dim: dim as usize,
                split_factor,
            }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => write!(f, "Replicate"),
            Placement::Shard(dim) => write!(f, "Shard({dim})"),
            Placement::StridedShard { dim, split_factor } => {
                write!(f, "StridedShard({dim},{split_factor})")
            }
            Placement::ShardBlocks { dim, block } => write!(f, "ShardBlocks({dim},{block})"),
        }
    }
}

/// One side of a reshard: which ranks hold the tensor and how.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// The ranks that hold the tensor on this side.
    pub mesh: Mesh,
    /// One placement per mesh axis, in axis order; axes that shard the same dim cut it in
    /// this order, left to right.
    pub placements: Vec<Placement>,
    /// Element strides of every rank's local view (one per tensor dim); `None` means dense
    /// row-major. The same strides apply on every rank of the mesh.
    pub strides: Option<Vec<u64>>,
}

/// The pieces one dim is cut into by a layout: the coordinates on the mesh axes that shard the
/// dim (in axis order) and the indices those ranks hold along it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DimPiece {
    /// The coordinate on each mesh axis that shards the dim, in axis order (the axes of
    /// [`Layout::shard_axes`]); empty when no axis shards it.
    pub coords: Vec<u64>,
    /// The global indices along the dim that the ranks at those coordinates hold (may be
    /// empty).
    pub indices: IndexRuns,
}

/// Which side of a reshard: where the tensor is (`src`) or where it goes (`dst`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The source: where the tensor is before the reshard ([`TensorSpec::src`]).
    Src,
    /// The destination: where the tensor goes ([`TensorSpec::dst`]).
    Dst,
}

/// One rank's part of one tensor on one side: the global indices it holds along every dim and
/// the byte geometry of its local buffer (whose `view.shape`, the number of indices per dim,
/// is the rank's local shape). Made by [`TensorSpec::rank_view`] (or [`Layout::rank_view`]),
/// the one function that goes from a rank to its indices, local shape and view: the planner,
/// the C API, the checker and the CLI all call it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankView {
    /// The global indices the rank holds, one set per tensor dim.
    pub indices: Vec<IndexRuns>,
    /// The byte geometry of the rank's local buffer; its shape is the size of each set in
    /// `indices`.
    pub view: LocalView,
}

impl RankView {
    /// The view of a rank holding `indices` (as [`Layout::rank_indices`] gives them) under
    /// `layout`, for elements of `elem_size` bytes.
    pub fn new(layout: &Layout, indices: Vec<IndexRuns>, elem_size: u32) -> RankView {
        let local_shape: Vec<u64> = indices.iter().map(IndexRuns::len).collect();
        RankView {
            view: layout.view(&local_shape, elem_size),
            indices,
        }
    }

    /// A dense row-major buffer holding `indices` in elements of `elem_size` bytes (a
    /// workspace image of a view, a grid of block scales).
    pub fn dense(indices: Vec<IndexRuns>, elem_size: u64) -> RankView {
        let shape: Vec<u64> = indices.iter().map(IndexRuns::len).collect();
        RankView {
            view: LocalView {
                strides: row_major_strides(&shape),
                shape,
                elem_size,
            },
            indices,
        }
    }

    /// The rank's local shape: how many indices it holds along each dim.
    pub fn local_shape(&self) -> &[u64] {
        &self.view.shape
    }
}

/// Byte geometry of one rank's local buffer for one tensor: the one place that turns local
/// positions into byte offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalView {
    /// The local shape, in elements per dim.
    pub shape: Vec<u64>,
    /// Element strides, one per dim.
    pub strides: Vec<u64>,
    /// Bytes per element.
    pub elem_size: u64,
}

impl LocalView {
    /// The number of elements in the view: the product of `shape` (1 for a 0-d view).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes from the view's first element to one past its last (0 for an empty view).
    pub fn extent_bytes(&self) -> u64 {
        if self.shape.contains(&0) {
            return 0;
        }
        let last: u64 = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum();
        (last + 1) * self.elem_size
    }

    /// Byte offset of the element at local position `pos`.
    pub fn byte_offset(&self, pos: &[u64]) -> u64 {
        pos.iter()
            .zip(&self.strides)
            .map(|(&p, &s)| p * s)
            .sum::<u64>()
            * self.elem_size
    }

    /// Byte strides, one per dim.
    pub fn byte_strides(&self) -> Vec<u64> {
        (0..self.strides.len())
            .map(|d| self.byte_stride(d))
            .collect()
    }

    /// Dim `d`'s byte stride ([`LocalView::byte_strides`] without the list).
    pub fn byte_stride(&self, d: usize) -> u64 {
        self.strides[d] * self.elem_size
    }
}

/// Steps a row-major multi-index (last position fastest, position `d` below `limit(d)`) to
/// the next one; returns false after the last, leaving the index all zeros again. The one
/// odometer every grid walk (blocks, copies, pieces, replicas) uses.
pub fn next_index<T>(index: &mut [T], limit: impl Fn(usize) -> T) -> bool
where
    T: Copy + PartialOrd + std::ops::AddAssign + From<u8>,
{
    for d in (0..index.len()).rev() {
        index[d] += T::from(1);
        if index[d] < limit(d) {
            return true;
        }
        index[d] = T::from(0);
    }
    false
}

/// Dense row-major element strides of `shape`.
pub fn row_major_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1].max(1);
    }
    strides
}

impl Layout {
    /// A layout with dense row-major local buffers. Nothing is checked here; see
    /// [`Layout::validate`].
    pub fn new(mesh: Mesh, placements: Vec<Placement>) -> Layout {
        Layout {
            mesh,
            placements,
            strides: None,
        }
    }

    /// This layout with every rank's local view given element `strides`, one per tensor dim
    /// (a view inside a larger buffer); [`Layout::validate`] checks that elements do not
    /// alias.
    pub fn with_strides(mut self, strides: Vec<u64>) -> Layout {
        self.strides = Some(strides);
        self
    }

    /// Mesh axes that shard tensor dim `dim`, in application order.
    pub fn shard_axes(&self, dim: usize) -> Vec<usize> {
        (0..self.placements.len())
            .filter(|&a| self.placements[a].dim() == Some(dim))
            .collect()
    }

    /// Mesh axes that shard no dim: ranks differing only there hold the same shard.
    pub fn replicate_axes(&self) -> Vec<usize> {
        (0..self.placements.len())
            .filter(|&a| self.placements[a].dim().is_none())
            .collect()
    }

    /// Applies one placement to the current index list along its dim.
    fn apply(&self, axis: usize, coord: u64, list: &IndexRuns) -> IndexRuns {
        let parts = self.mesh.shape()[axis];
        match self.placements[axis] {
            Placement::Replicate => list.clone(),
            Placement::Shard(_) => list.shard(parts, coord),
            Placement::StridedShard { split_factor, .. } => {
                list.strided_shard(parts, coord, split_factor)
            }
            Placement::ShardBlocks { block, .. } => list.shard_blocks(coord, block),
        }
    }

    /// The indices along every dim held by the rank at mesh coordinate `coord`.
    pub fn local_indices(&self, shape: &[u64], coord: &[u64]) -> Vec<IndexRuns> {
        (0..shape.len())
            .map(|dim| {
                self.shard_axes(dim)
                    .into_iter()
                    .fold(IndexRuns::full(shape[dim]), |list, axis| {
                        self.apply(axis, coord[axis], &list)
                    })
            })
            .collect()
    }

    /// How many distinct shards the layout cuts a tensor into (at least 1): the product of the
    /// mesh axes that shard some dim; each shard has `mesh.size() / shards()` replicas.
    pub fn shards(&self) -> u64 {
        let shape = self.mesh.shape();
        (0..self.placements.len().min(shape.len()))
            .filter(|&a| self.placements[a].dim().is_some())
            .map(|a| shape[a])
            .product::<u64>()
            .max(1)
    }

    /// A number naming `rank`'s shard, `None` when it is not in the mesh: its coordinates on
    /// the axes that shard some dim, mixed-radix. Ranks with equal numbers hold the same
    /// indices (replicas differ only on the other axes), so a planner computes a shard's
    /// indices and view once for all its replicas.
    pub fn shard_number(&self, rank: u32) -> Option<u64> {
        let mut index = self.mesh.index_of(rank)? as u64;
        let shape = self.mesh.shape();
        let (mut number, mut scale) = (0u64, 1u64);
        for axis in (0..shape.len()).rev() {
            let n = shape[axis].max(1);
            let coord = index % n;
            index /= n;
            if self.placements.get(axis).and_then(Placement::dim).is_some() {
                number += coord * scale;
                scale *= n;
            }
        }
        Some(number)
    }

    /// The indices along every dim held by `rank`, or `None` when it is not in the mesh.
    pub fn rank_indices(&self, shape: &[u64], rank: u32) -> Option<Vec<IndexRuns>> {
        self.mesh
            .coord_of(rank)
            .map(|coord| self.local_indices(shape, &coord))
    }

    /// `rank`'s indices and view for a tensor of global `shape` and `elem_size`-byte elements,
    /// or `None` when it is not in the mesh (see [`RankView`]).
    pub fn rank_view(&self, shape: &[u64], elem_size: u32, rank: u32) -> Option<RankView> {
        self.rank_indices(shape, rank)
            .map(|indices| RankView::new(self, indices, elem_size))
    }

    /// Every piece dim `dim` is cut into, in row-major order of the sharding axes' coordinates
    /// (empty pieces included).
    pub fn dim_pieces(&self, shape: &[u64], dim: usize) -> Vec<DimPiece> {
        let mut pieces = vec![DimPiece {
            coords: Vec::new(),
            indices: IndexRuns::full(shape[dim]),
        }];
        for axis in self.shard_axes(dim) {
            pieces = pieces
                .iter()
                .flat_map(|piece| {
                    (0..self.mesh.shape()[axis]).map(move |c| {
                        let mut coords = piece.coords.clone();
                        coords.push(c);
                        DimPiece {
                            coords,
                            indices: self.apply(axis, c, &piece.indices),
                        }
                    })
                })
                .collect();
        }
        pieces
    }

    /// The ranks holding the shard whose coordinates on the sharding axes are given per dim
    /// (`coords[d]` lists the coordinates on `shard_axes(d)`), in row-major mesh order; holes
    /// hold nothing (none at all when every replica is gone).
    pub fn replicas(&self, coords: &[&[u64]]) -> Vec<u32> {
        let mut base = vec![0u64; self.mesh.ndim()];
        for (dim, dim_coords) in coords.iter().enumerate() {
            for (axis, &c) in self.shard_axes(dim).into_iter().zip(dim_coords.iter()) {
                base[axis] = c;
            }
        }
        let free = self.replicate_axes();
        let mut out = Vec::new();
        let mut coord = base;
        loop {
            let rank = self.mesh.rank_at(&coord);
            if rank != Mesh::HOLE {
                out.push(rank);
            }
            // Odometer over the replicate axes, last axis fastest (row-major order).
            let mut k = free.len();
            loop {
                if k == 0 {
                    return out;
                }
                k -= 1;
                let axis = free[k];
                coord[axis] += 1;
                if coord[axis] < self.mesh.shape()[axis] {
                    break;
                }
                coord[axis] = 0;
            }
        }
    }

    /// Byte geometry of a rank's local buffer whose local shape is `local_shape` (a rank's
    /// whole view, indices included, comes from [`Layout::rank_view`]).
    pub fn view(&self, local_shape: &[u64], elem_size: u32) -> LocalView {
        LocalView {
            shape: local_shape.to_vec(),
            strides: self
                .strides
                .clone()
                .unwrap_or_else(|| row_major_strides(local_shape)),
            elem_size: u64::from(elem_size),
        }
    }

    /// Checks this layout against a tensor's global `shape` (which [`validate_shape`]
    /// accepted) of `elem_size`-byte elements. Errors begin with `field`, the name the caller
    /// knows the layout by (`src`, `dst`, the C API's `layout`), then, where one field is at
    /// fault, name it (`src: placements[1] = …`); limits of the whole layout (its largest view,
    /// what its placements cut a dim into) are said as such.
    pub fn validate(&self, shape: &[u64], elem_size: u32, field: &str) -> Result<()> {
        self.check(shape, elem_size).map_err(|e| e.context(field))
    }

    fn check(&self, shape: &[u64], elem_size: u32) -> Result<()> {
        let ndim = self.mesh.ndim();
        if self.placements.len() != ndim {
            return Err(Error::invalid_argument(format!(
                "placements has {} entries but the mesh has {ndim} axes; give one placement per mesh axis",
                self.placements.len()
            )));
        }
        for (axis, placement) in self.placements.iter().enumerate() {
            if let Some(dim) = placement.dim() {
                if dim >= shape.len() {
                    return Err(Error::invalid_argument(format!(
                        "placements[{axis}] = {placement} shards dim {dim} but the tensor has {} dims",
                        shape.len()
                    )));
                }
            }
            if let Placement::StridedShard { split_factor, .. } = placement {
                if *split_factor == 0 {
                    return Err(Error::invalid_argument(format!(
                        "placements[{axis}] = {placement}: split_factor must be at least 1"
                    )));
                }
            }
            if let Placement::ShardBlocks { block: 0, .. } = placement {
                return Err(Error::invalid_argument(format!(
                    "placements[{axis}] = {placement}: block must be at least 1"
                )));
            }
        }
        // A rank's index set along a dim has at most one run per StridedShard piece that can
        // hold an index (min(split factor, dim size) per axis); bound their product so a
        // descriptor cannot ask for unbounded memory or time.
        for (dim, &size) in shape.iter().enumerate() {
            let product = self.shard_axes(dim).iter().try_fold(1u64, |acc, &axis| {
                match self.placements[axis] {
                    Placement::StridedShard { split_factor, .. } => {
                        acc.checked_mul(split_factor.min(size.max(1)))
                    }
                    _ => Some(acc),
                }
            });
            if !matches!(product, Some(p) if p <= MAX_SPLIT_PRODUCT) {
                return Err(Error::invalid_argument(format!(
                    "the StridedShard placements on dim {dim} cut it into more than {MAX_SPLIT_PRODUCT} pieces; no real layout needs that many"
                )));
            }
        }
        // ShardBlocks must cover what it cuts, as torch's placements do (every index on some
        // coordinate): k blocks of `block` indices reach every index of each list it cuts.
        for (dim, &size) in shape.iter().enumerate() {
            let axes = self.shard_axes(dim);
            if !axes
                .iter()
                .any(|&a| matches!(self.placements[a], Placement::ShardBlocks { .. }))
            {
                continue;
            }
            let mut lists = vec![IndexRuns::full(size)];
            for &axis in &axes {
                let k = self.mesh.shape()[axis];
                if let Placement::ShardBlocks { block, .. } = self.placements[axis] {
                    if let Some(list) = lists.iter().find(|l| l.len() > k.saturating_mul(block)) {
                        return Err(Error::invalid_argument(format!(
                            "placements[{axis}] = {}: {k} blocks of {block} cover {} of the {} indices of dim {dim} it cuts; a block must be at least {} (every index needs a rank)",
                            self.placements[axis],
                            k.saturating_mul(block),
                            list.len(),
                            list.len().div_ceil(k)
                        )));
                    }
                }
                lists = lists
                    .iter()
                    .flat_map(|list| (0..k).map(move |c| self.apply(axis, c, list)))
                    .collect();
            }
        }
        // The largest local extent per dim bounds every rank's view.
        let max_local: Vec<u64> = (0..shape.len())
            .map(|d| {
                self.dim_pieces(shape, d)
                    .iter()
                    .map(|p| p.indices.len())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        // Every byte offset and stride of a view must fit in an i64 (ptrdiff_t on the device,
        // and the planner's arithmetic), whatever the rank, so ranks never disagree.
        let fits = |bytes: u64, what: &str| -> Result<()> {
            if bytes > i64::MAX as u64 {
                return Err(Error::invalid_argument(format!(
                    "{what} is {bytes} bytes, past 2^63; no buffer is that large"
                )));
            }
            Ok(())
        };
        let strides = match &self.strides {
            None => {
                // Row-major strides multiply the extents of the dims after each one, zero or
                // not: bound the product with empty dims counted as 1.
                let elements = max_local
                    .iter()
                    .try_fold(1u64, |acc, &n| checked_mul(acc, n.max(1), "local elements"))?;
                let bytes = checked_mul(elements, u64::from(elem_size), "local buffer bytes")?;
                fits(bytes, "the largest local view")?;
                return Ok(());
            }
            Some(strides) => strides,
        };
        if strides.len() != shape.len() {
            return Err(Error::invalid_argument(format!(
                "strides has {} entries but the tensor has {} dims",
                strides.len(),
                shape.len()
            )));
        }
        for (d, &stride) in strides.iter().enumerate() {
            let bytes = checked_mul(stride, u64::from(elem_size), &format!("strides[{d}]"))?;
            fits(bytes, &format!("strides[{d}] = {stride} elements"))?;
        }
        // Views may be padded or sliced but must not alias: sorted by stride, each dim must step
        // past everything the smaller-stride dims span.
        let mut dims: Vec<usize> = (0..shape.len()).filter(|&d| max_local[d] > 1).collect();
        dims.sort_by_key(|&d| strides[d]);
        let mut span = 1u64;
        for &d in &dims {
            if strides[d] < span {
                return Err(Error::invalid_argument(format!(
                    "strides[{d}] = {} makes elements of the local view overlap (it must be at least {span}); strides are in elements",
                    strides[d]
                )));
            }
            let reach = checked_mul(max_local[d] - 1, strides[d], "local view extent")?;
            span = checked_add(span, reach, "local view extent")?;
        }
        let bytes = checked_mul(span, u64::from(elem_size), "local view bytes")?;
        fits(bytes, "the largest local view")?;
        Ok(())
    }
}

/// Checks a tensor's global shape of `elem_size`-byte elements: at most [`MAX_TENSOR_DIMS`]
/// dims and a byte size that byte offsets can address. Errors name `shape`.
pub fn validate_shape(shape: &[u64], elem_size: u32) -> Result<()> {
    if shape.len() > MAX_TENSOR_DIMS {
        return Err(Error::invalid_argument(format!(
            "shape has {} dims; at most {MAX_TENSOR_DIMS} are supported",
            shape.len()
        )));
    }
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &n| checked_mul(acc, n, "shape: element count"))?;
    let bytes = checked_mul(elements, u64::from(elem_size), "shape: tensor bytes")?;
    if bytes > i64::MAX as u64 {
        return Err(Error::invalid_argument(format!(
            "shape {shape:?}: {bytes} bytes exceeds the 63-bit byte offsets buffers allow"
        )));
    }
    Ok(())
}

/// One tensor of a reshard: its global shape and element type, where it is and where it goes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// The global shape, in elements per dim (at most [`MAX_TENSOR_DIMS`] dims).
    pub shape: Vec<u64>,
    /// The element type on both sides, or the source's when a
    /// [`Conversion`](crate::quant::Conversion) gives the destination another.
    pub dtype: DType,
    /// The source layout: where the tensor is.
    pub src: Layout,
    /// The destination layout: where the tensor goes.
    pub dst: Layout,
}

impl TensorSpec {
    /// Bytes per element of `dtype`.
    pub fn elem_size(&self) -> u32 {
        self.dtype.size()
    }

    /// The layout of one side.
    pub fn layout(&self, side: Side) -> &Layout {
        match side {
            Side::Src => &self.src,
            Side::Dst => &self.dst,
        }
    }

    /// `rank`'s indices, local shape and view of this tensor on `side`, or `None` when the
    /// rank is not in that side's mesh.
    pub fn rank_view(&self, side: Side, rank: u32) -> Option<RankView> {
        self.layout(side)
            .rank_view(&self.shape, self.elem_size(), rank)
    }

    /// Validates shape and both layouts; the message names the field (`shape`, `src: …`).
    pub fn validate(&self) -> Result<()> {
        validate_shape(&self.shape, self.elem_size())?;
        self.src.validate(&self.shape, self.elem_size(), "src")?;
        self.dst.validate(&self.shape, self.elem_size(), "dst")
    }
}

#[cfg(test)]
mod tests {
    use super::Placement;

    #[test]
    fn placements_parse_by_position_or_by_torch_keyword() {
        let strided = |dim, split_factor| Placement::StridedShard { dim, split_factor };
        for (text, want) in [
            ("Replicate()", Placement::Replicate),
            ("S(1)", Placement::Shard(1)),
            ("Shard(dim=2)", Placement::Shard(2)),
            ("StridedShard(0, 2)", strided(0, 2)),
            ("_StridedShard(dim=0, split_factor=2)", strided(0, 2)),
            ("_StridedShard(split_factor=2, dim=0)", strided(0, 2)),
            ("_StridedShard(1, split_factor=3)", strided(1, 3)),
        ] {
            assert_eq!(Placement::parse(text).unwrap(), want, "{text}");
        }
        // Keywords torch does not have, a value given twice, positions after keywords, and
        // missing or extra arguments are refused, naming the text.
        for text in [
            "Shard(foo=0)",
            "Shard(0, dim=1)",
            "_StridedShard(split_factor=2, 0)",
            "_StridedShard(dim=0)",
            "Shard(0, 1)",
            "Shard()",
        ] {
            let err = Placement::parse(text).expect_err(text);
            assert!(err.message.contains(text), "{err}");
        }
    }

    #[test]
    fn shard_blocks_hold_vllms_vocab_blocks_and_must_cover_the_dim() {
        use super::{DType, Layout, Mesh, TensorSpec};
        let blocks = |block| Placement::ShardBlocks { dim: 0, block };
        assert_eq!(
            Placement::parse("ShardBlocks(dim=0, block=288)").unwrap(),
            blocks(288)
        );
        assert_eq!(blocks(288).to_string(), "ShardBlocks(0,288)");
        // vLLM: a vocabulary of 1100 padded to 1152, TP 4: blocks of 288 rows, the last short
        // (torch.chunk would give 275 each).
        let layout = Layout::new(Mesh::contiguous(vec![4], 0).unwrap(), vec![blocks(288)]);
        let rows: Vec<(u64, u64)> = (0..4)
            .map(|r| {
                let runs = &layout.rank_indices(&[1100, 8], r).unwrap()[0];
                (runs.first().unwrap_or(0), runs.len())
            })
            .collect();
        assert_eq!(rows, [(0, 288), (288, 288), (576, 288), (864, 236)]);
        // Blocks that leave indices to no rank are refused, saying how large a block must be.
        let spec = |block| TensorSpec {
            shape: vec![1100, 8],
            dtype: DType::Bfloat16,
            src: Layout::new(Mesh::contiguous(vec![4], 0).unwrap(), vec![blocks(block)]),
            dst: Layout::new(
                Mesh::contiguous(vec![1], 4).unwrap(),
                vec![Placement::Replicate],
            ),
        };
        assert!(spec(275).validate().is_ok());
        let err = spec(274).validate().expect_err("274 x 4 < 1100");
        assert!(
            err.message.contains("a block must be at least 275"),
            "{err}"
        );
        let err = spec(0).validate().expect_err("block 0");
        assert!(err.message.contains("block must be at least 1"), "{err}");
    }
}
