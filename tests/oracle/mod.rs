//! A brute-force model of PyTorch DTensor's sharding rules, written independently of
//! `ncclreshard::layout` and `ncclreshard::plan` (docs/design.md §7, STYLE rule 8).
//!
//! It reads only the plain fields of the crate's data types (`Mesh::shape`, `Mesh::ranks`,
//! `Layout::placements`, `Layout::strides`) and works on expanded index lists, one `Vec<u64>`
//! per dim, literally following torch:
//!
//! - `Shard` over an axis of size k: `torch.chunk` into k parts of `ceil(n / k)` elements,
//!   the missing trailing parts filled with empty tensors (5 over 4 → 2, 2, 1, 0).
//! - `_StridedShard(split_factor)`: `torch.chunk` into `split_factor` pieces (empty-filled),
//!   each piece chunked into k parts the same way; part c of the axis is the concatenation of
//!   part c of every piece, in piece order.
//! - Placements are applied left to right over the mesh axes; a rank's coordinate comes from a
//!   linear search of the row-major rank table (last axis fastest).
//!
//! Slow on purpose: everything here is per element. Keep the tensors small.

#![allow(dead_code)]

use ncclreshard::{Layout, Placement};

/// Part `c` of `parts` of `list` by torch.chunk + empty fill.
pub fn chunk_part(list: &[u64], parts: u64, c: u64) -> Vec<u64> {
    assert!(parts > 0 && c < parts, "chunk part {c} of {parts}");
    let n = list.len() as u64;
    let chunk = n.div_ceil(parts);
    let start = (c * chunk).min(n) as usize;
    let end = ((c + 1) * chunk).min(n) as usize;
    list[start..end].to_vec()
}

/// Part `c` of `parts` of `list` by torch's `_StridedShard._split_tensor`.
pub fn strided_part(list: &[u64], parts: u64, c: u64, split_factor: u64) -> Vec<u64> {
    assert!(split_factor > 0, "split_factor 0");
    let mut out = Vec::new();
    for j in 0..split_factor {
        let piece = chunk_part(list, split_factor, j);
        out.extend(chunk_part(&piece, parts, c));
    }
    out
}

/// Coordinate `c`'s block of `block` entries of `list` (ShardBlocks): entries
/// `c·block .. (c+1)·block`, those that exist.
pub fn block_part(list: &[u64], c: u64, block: u64) -> Vec<u64> {
    list.iter()
        .enumerate()
        .filter(|&(i, _)| i as u64 / block == c)
        .map(|(_, &x)| x)
        .collect()
}

/// The coordinate of `rank` in the layout's mesh, by linear search of the rank table.
pub fn coordinate(layout: &Layout, rank: u32) -> Option<Vec<u64>> {
    let shape = layout.mesh.shape();
    let position = layout.mesh.ranks().iter().position(|&r| r == rank)? as u64;
    let mut coord = vec![0u64; shape.len()];
    let mut inner = 1u64;
    for axis in (0..shape.len()).rev() {
        coord[axis] = (position / inner) % shape[axis];
        inner *= shape[axis];
    }
    Some(coord)
}

/// The global indices `rank` holds along every dim, in local order; `None` outside the mesh.
pub fn local_index_lists(shape: &[u64], layout: &Layout, rank: u32) -> Option<Vec<Vec<u64>>> {
    let coord = coordinate(layout, rank)?;
    let mesh_shape = layout.mesh.shape();
    let mut lists: Vec<Vec<u64>> = shape.iter().map(|&n| (0..n).collect()).collect();
    for (axis, placement) in layout.placements.iter().enumerate() {
        let k = mesh_shape[axis];
        let c = coord[axis];
        match *placement {
            Placement::Replicate => {}
            Placement::Shard(d) => lists[d] = chunk_part(&lists[d], k, c),
            Placement::StridedShard { dim, split_factor } => {
                lists[dim] = strided_part(&lists[dim], k, c, split_factor)
            }
            Placement::ShardBlocks { dim, block } => lists[dim] = block_part(&lists[dim], c, block),
        }
    }
    Some(lists)
}

/// Every rank that appears in the mesh, in row-major table order.
pub fn mesh_ranks(layout: &Layout) -> Vec<u32> {
    layout.mesh.ranks().to_vec()
}

/// Row-major linear index of a multi-index.
pub fn linear_index(shape: &[u64], multi: &[u64]) -> u64 {
    multi
        .iter()
        .zip(shape)
        .fold(0u64, |acc, (&i, &n)| acc * n + i)
}

/// The multi-index of a row-major linear index.
pub fn multi_index(shape: &[u64], mut linear: u64) -> Vec<u64> {
    let mut multi = vec![0u64; shape.len()];
    for d in (0..shape.len()).rev() {
        multi[d] = linear % shape[d];
        linear /= shape[d];
    }
    multi
}

pub fn element_count(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Ranks holding the element at `global` (a multi-index), by asking every rank of the mesh.
/// Row-major mesh order.
pub fn owners(shape: &[u64], layout: &Layout, global: &[u64]) -> Vec<u32> {
    mesh_ranks(layout)
        .into_iter()
        .filter(|&r| {
            let lists = local_index_lists(shape, layout, r).expect("rank of the mesh");
            lists.iter().zip(global).all(|(list, i)| list.contains(i))
        })
        .collect()
}

/// Owners of every element, indexed by global linear index: the same brute force as
/// [`owners`], with each rank's lists computed once.
pub fn owner_table(shape: &[u64], layout: &Layout) -> Vec<Vec<u32>> {
    let count = element_count(shape) as usize;
    let mut table = vec![Vec::new(); count];
    for r in mesh_ranks(layout) {
        let lists = local_index_lists(shape, layout, r).expect("rank of the mesh");
        let held: Vec<Vec<bool>> = shape
            .iter()
            .zip(&lists)
            .map(|(&n, list)| {
                let mut held = vec![false; n as usize];
                list.iter().for_each(|&i| held[i as usize] = true);
                held
            })
            .collect();
        for (linear, owners) in table.iter_mut().enumerate() {
            let multi = multi_index(shape, linear as u64);
            if multi.iter().enumerate().all(|(d, &i)| held[d][i as usize]) {
                owners.push(r);
            }
        }
    }
    table
}

/// Dense row-major element strides of `shape`.
pub fn dense_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; shape.len()];
    let mut step = 1u64;
    for d in (0..shape.len()).rev() {
        strides[d] = step;
        step *= shape[d].max(1);
    }
    strides
}

/// Element strides of a local view: the given ones, or dense row-major.
pub fn view_strides(local_shape: &[u64], strides: Option<&[u64]>) -> Vec<u64> {
    match strides {
        Some(s) => s.to_vec(),
        None => dense_strides(local_shape),
    }
}

/// Byte offset of local position `pos` in a view.
pub fn local_byte_offset(
    local_shape: &[u64],
    strides: Option<&[u64]>,
    elem_size: u64,
    pos: &[u64],
) -> u64 {
    let strides = view_strides(local_shape, strides);
    let mut elements = 0u64;
    for (p, s) in pos.iter().zip(&strides) {
        elements += p * s;
    }
    elements * elem_size
}

/// Bytes from a view's first element to one past its highest one (0 when it holds none).
pub fn view_extent_bytes(local_shape: &[u64], strides: Option<&[u64]>, elem_size: u64) -> u64 {
    if local_shape.contains(&0) {
        return 0;
    }
    let last: Vec<u64> = local_shape.iter().map(|&n| n - 1).collect();
    local_byte_offset(local_shape, strides, elem_size, &last) + elem_size
}

/// Calls `f(local position, global multi-index)` for every element of a rank's local tensor
/// given its per-dim index lists, local positions in row-major order.
pub fn for_each_local_element(lists: &[Vec<u64>], mut f: impl FnMut(&[u64], &[u64])) {
    let local_shape: Vec<u64> = lists.iter().map(|l| l.len() as u64).collect();
    let count = element_count(&local_shape);
    let mut global = vec![0u64; lists.len()];
    for linear in 0..count {
        let pos = multi_index(&local_shape, linear);
        for d in 0..lists.len() {
            global[d] = lists[d][pos[d] as usize];
        }
        f(&pos, &global);
    }
}

/// The largest local extent along every dim over all ranks of the mesh.
pub fn max_local_shape(shape: &[u64], layout: &Layout) -> Vec<u64> {
    let mut max = vec![0u64; shape.len()];
    for r in mesh_ranks(layout) {
        let lists = local_index_lists(shape, layout, r).expect("rank of the mesh");
        for (m, list) in max.iter_mut().zip(&lists) {
            *m = (*m).max(list.len() as u64);
        }
    }
    max
}

/// The value tensor `tensor`'s element `global` (row-major linear index) carries: a 64-bit mix
/// of both, of which the first `elem_size` little-endian bytes are stored.
pub fn element_bytes(tensor: usize, global: u64, elem_size: usize) -> Vec<u8> {
    let mut x = global
        .wrapping_add((tensor as u64).wrapping_mul(0xd6e8_feb8_6659_fd93))
        .wrapping_add(0x632b_e59b_d9b4_e019);
    x ^= x >> 32;
    x = x.wrapping_mul(0xd6e8_feb8_6659_fd93);
    x ^= x >> 32;
    x = x.wrapping_mul(0xd6e8_feb8_6659_fd93);
    x ^= x >> 32;
    x.to_le_bytes()[..elem_size].to_vec()
}

/// The byte at `offset` of a buffer outside every element of the view it holds.
pub fn sentinel_byte(rank: u32, tensor: usize, side: u8, offset: usize) -> u8 {
    let x = (offset as u64)
        .wrapping_mul(0x9e37_79b9)
        .wrapping_add(u64::from(rank) * 131 + tensor as u64 * 17 + u64::from(side) * 7);
    (x ^ (x >> 13) ^ 0x5a) as u8
}

/// Random layouts for property tests. Generation only; nothing here decides what is correct.
pub mod strategies {
    use ncclreshard::{DType, Layout, Mesh, Placement, TensorSpec};
    use proptest::prelude::*;

    /// Replicate, Shard(d), StridedShard(d, 1..=4) or ShardBlocks(d, 1..=5) for a tensor of
    /// `ndim` dims.
    pub fn placement(ndim: usize) -> BoxedStrategy<Placement> {
        if ndim == 0 {
            return Just(Placement::Replicate).boxed();
        }
        prop_oneof![
            1 => Just(Placement::Replicate),
            2 => (0..ndim).prop_map(Placement::Shard),
            2 => (0..ndim, 1u64..=4)
                .prop_map(|(dim, split_factor)| Placement::StridedShard { dim, split_factor }),
            // `block` is what [`fit_blocks`] adds to the least block covering the dim.
            1 => (0..ndim, 0u64..=2).prop_map(|(dim, block)| Placement::ShardBlocks { dim, block }),
        ]
        .boxed()
    }

    /// A rank table of `size` distinct ranks: contiguous from some first rank, a shuffled
    /// subset of a slightly larger range, or an arithmetic progression.
    pub fn rank_table(size: usize, spare: u32) -> BoxedStrategy<Vec<u32>> {
        let n = size as u32;
        prop_oneof![
            (0..=spare).prop_map(move |first| (first..first + n).collect()),
            Just((0..n + spare).collect::<Vec<u32>>())
                .prop_shuffle()
                .prop_map(move |all| all[..size].to_vec()),
            (2u32..=3, 0..=spare)
                .prop_map(move |(step, first)| { (0..n).map(|i| first + step * i).collect() }),
        ]
        .boxed()
    }

    /// Mesh shapes of 1..=`max_axes` axes of 1..=`max_axis` ranks, at most `max_ranks` ranks.
    pub fn mesh_shape(max_axes: usize, max_axis: u64, max_ranks: u64) -> BoxedStrategy<Vec<u64>> {
        prop::collection::vec(1u64..=max_axis, 1..=max_axes)
            .prop_filter("mesh too large", move |s| {
                s.iter().product::<u64>() <= max_ranks
            })
            .boxed()
    }

    pub fn mesh(max_axes: usize, max_axis: u64, max_ranks: u64, spare: u32) -> BoxedStrategy<Mesh> {
        mesh_shape(max_axes, max_axis, max_ranks)
            .prop_flat_map(move |shape| {
                let size = shape.iter().product::<u64>() as usize;
                rank_table(size, spare)
                    .prop_map(move |ranks| Mesh::new(shape.clone(), ranks).expect("valid mesh"))
            })
            .boxed()
    }

    /// `layout` for a tensor of `shape`: each ShardBlocks block raised by the least block
    /// that covers the whole dim on its axis (`ceil(len / k)`), so the blocks partition the dim
    /// as the library requires, with empty trailing coordinates when the extra is large.
    pub fn fit_blocks(shape: &[u64], mut layout: Layout) -> Layout {
        let mesh_shape = layout.mesh.shape().to_vec();
        for (axis, p) in layout.placements.iter_mut().enumerate() {
            if let Placement::ShardBlocks { dim, block } = p {
                let len = shape.get(*dim).copied().unwrap_or(0);
                *block += len.div_ceil(mesh_shape[axis]).max(1);
            }
        }
        layout
    }

    /// `layout` with each ShardBlocks a Shard of the same dim, for layouts whose tensor's shape
    /// is not known yet (a scale tensor's).
    pub fn without_blocks(mut layout: Layout) -> Layout {
        for p in &mut layout.placements {
            if let Placement::ShardBlocks { dim, .. } = *p {
                *p = Placement::Shard(dim);
            }
        }
        layout
    }

    /// Placements for every axis of `mesh`, sharding dims of an `ndim`-dim tensor.
    pub fn layout_on(mesh: Mesh, ndim: usize) -> BoxedStrategy<Layout> {
        prop::collection::vec(placement(ndim), mesh.ndim())
            .prop_map(move |placements| Layout::new(mesh.clone(), placements))
            .boxed()
    }

    pub fn layout(ndim: usize, max_ranks: u64, spare: u32) -> BoxedStrategy<Layout> {
        mesh(3, 4, max_ranks, spare)
            .prop_flat_map(move |m| layout_on(m, ndim))
            .boxed()
    }

    /// Tensor shapes: rank 0..=4 with dims 0..=12, or rank 5..=8 with dims 0..=3.
    pub fn shape() -> BoxedStrategy<Vec<u64>> {
        prop_oneof![
            4 => prop::collection::vec(0u64..=12, 0..=4),
            1 => prop::collection::vec(0u64..=3, 5..=8),
        ]
        .boxed()
    }

    /// How to lay out a strided view: dims from innermost to outermost in `order` (a
    /// permutation of 0..8, dims past the tensor's rank skipped) and extra elements of padding
    /// after each dim.
    #[derive(Clone, Debug)]
    pub struct StrideRecipe {
        pub order: Vec<usize>,
        pub pads: Vec<u64>,
    }

    pub fn stride_recipe() -> BoxedStrategy<StrideRecipe> {
        (
            Just((0..8).collect::<Vec<usize>>()).prop_shuffle(),
            prop::collection::vec(0u64..=3, 9),
        )
            .prop_map(|(order, pads)| StrideRecipe { order, pads })
            .boxed()
    }

    /// A tensor of `shape` and `dtype` with layouts from `src` and `dst`, each view strided by a
    /// random recipe now and then (source 25 %, destination 35 % of the time) or dense.
    pub fn tensor_on(
        shape: Vec<u64>,
        dtype: DType,
        src: BoxedStrategy<Layout>,
        dst: BoxedStrategy<Layout>,
    ) -> BoxedStrategy<TensorSpec> {
        (
            src,
            dst,
            prop::option::weighted(0.25, stride_recipe()),
            prop::option::weighted(0.35, stride_recipe()),
        )
            .prop_map(move |(src, dst, src_recipe, dst_recipe)| {
                let (mut src, mut dst) = (fit_blocks(&shape, src), fit_blocks(&shape, dst));
                if let Some(r) = src_recipe {
                    src.strides = Some(r.strides(&super::max_local_shape(&shape, &src)));
                }
                if let Some(r) = dst_recipe {
                    dst.strides = Some(r.strides(&super::max_local_shape(&shape, &dst)));
                }
                TensorSpec {
                    shape: shape.clone(),
                    dtype,
                    src,
                    dst,
                }
            })
            .boxed()
    }

    impl StrideRecipe {
        /// Non-aliasing element strides for views no larger than `max_local` along any dim:
        /// each dim steps past everything the dims inside it span, plus padding.
        pub fn strides(&self, max_local: &[u64]) -> Vec<u64> {
            let mut strides = vec![0u64; max_local.len()];
            let mut step = 1 + self.pads[8];
            for (k, &d) in self
                .order
                .iter()
                .filter(|&&d| d < max_local.len())
                .enumerate()
            {
                strides[d] = step;
                step = step * max_local[d].max(1) + self.pads[k];
            }
            strides
        }
    }
}
