//! Layouts against the brute-force torch oracle (docs/design.md §2, §7 step 1): every rank's index
//! lists, every element's owners, view geometry, torch's documented examples, and bad
//! descriptors rejected with an error that names the field.

mod oracle;

use ncclreshard::{
    Config, DType, IndexRuns, Layout, Mesh, Placement, Planner, TensorSpec, Topology,
};
use oracle::strategies::{fit_blocks, layout, shape, stride_recipe, StrideRecipe};
use proptest::prelude::*;

fn expand(runs: &IndexRuns) -> Vec<u64> {
    runs.runs().iter().flat_map(|r| r.start..r.end).collect()
}

fn crate_lists(shape: &[u64], layout: &Layout, rank: u32) -> Option<Vec<Vec<u64>>> {
    layout
        .rank_indices(shape, rank)
        .map(|dims| dims.iter().map(expand).collect())
}

/// A shape and a layout sharding it, over meshes of up to 64 ranks.
fn shaped_layout(max_ranks: u64) -> impl Strategy<Value = (Vec<u64>, Layout)> {
    shape().prop_flat_map(move |s| {
        let ndim = s.len();
        (
            Just(s.clone()),
            layout(ndim, max_ranks, 6).prop_map(move |l| fit_blocks(&s, l)),
        )
    })
}

fn mesh_of(shape: &[u64], ranks: &[u32]) -> Mesh {
    Mesh::new(shape.to_vec(), ranks.to_vec()).expect("valid mesh")
}

fn contiguous(shape: &[u64]) -> Mesh {
    Mesh::contiguous(shape.to_vec(), 0).expect("valid mesh")
}

fn spec(shape: &[u64], dtype: DType, src: Layout, dst: Layout) -> TensorSpec {
    TensorSpec {
        shape: shape.to_vec(),
        dtype,
        src,
        dst,
    }
}

fn replicated(ranks: u64) -> Layout {
    Layout::new(contiguous(&[ranks]), vec![Placement::Replicate])
}

/// Product of the sizes of the mesh axes that shard no dim.
fn replication(layout: &Layout) -> usize {
    layout
        .placements
        .iter()
        .zip(layout.mesh.shape())
        .filter(|(p, _)| matches!(p, Placement::Replicate))
        .map(|(_, &n)| n as usize)
        .product()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn rank_indices_match_oracle((shape, layout) in shaped_layout(64)) {
        let spec = spec(&shape, DType::Float32, layout.clone(), layout.clone());
        prop_assert!(spec.validate().is_ok(), "{:?}", spec.validate());
        let highest = layout.mesh.ranks().iter().copied().max().unwrap_or(0);
        for rank in 0..=highest + 2 {
            let want = oracle::local_index_lists(&shape, &layout, rank);
            let got = crate_lists(&shape, &layout, rank);
            prop_assert_eq!(got, want, "rank {}", rank);
        }
    }

    #[test]
    fn every_element_has_the_oracles_owners((shape, layout) in shaped_layout(64)) {
        let want = oracle::owner_table(&shape, &layout);
        // The crate's owners: ranks whose index runs hold the element, at the oracle's
        // local position.
        let mut got = vec![Vec::new(); want.len()];
        for &rank in layout.mesh.ranks() {
            let runs = layout.rank_indices(&shape, rank).expect("rank of the mesh");
            let lists = oracle::local_index_lists(&shape, &layout, rank).expect("rank of the mesh");
            for (linear, owners) in got.iter_mut().enumerate() {
                let multi = oracle::multi_index(&shape, linear as u64);
                let positions: Vec<Option<u64>> =
                    runs.iter().zip(&multi).map(|(r, &i)| r.position_of(i)).collect();
                if positions.iter().all(Option::is_some) {
                    owners.push(rank);
                }
                for (d, (p, &i)) in positions.iter().zip(&multi).enumerate() {
                    let expected = lists[d].iter().position(|&x| x == i).map(|p| p as u64);
                    prop_assert_eq!(*p, expected, "rank {} dim {} index {}", rank, d, i);
                }
            }
        }
        prop_assert_eq!(&got, &want);
        // torch's shards partition every dim, so each element lives on exactly one shard and
        // all of its replicas.
        let copies = replication(&layout);
        for (linear, owners) in want.iter().enumerate() {
            prop_assert_eq!(owners.len(), copies, "element {}", linear);
        }
        // The per-element brute force agrees with the table on a few elements.
        for linear in [0, want.len() / 2, want.len().saturating_sub(1)] {
            if linear < want.len() {
                let multi = oracle::multi_index(&shape, linear as u64);
                prop_assert_eq!(&oracle::owners(&shape, &layout, &multi), &want[linear]);
            }
        }
    }

    #[test]
    fn stacked_axes_on_one_dim(
        n in 0u64..=40,
        placements in prop::collection::vec(
            prop_oneof![
                (0usize..1).prop_map(Placement::Shard),
                (1u64..=4).prop_map(|split_factor| Placement::StridedShard { dim: 0, split_factor }),
                (0u64..=2).prop_map(|block| Placement::ShardBlocks { dim: 0, block }),
            ],
            2..=3,
        ),
        sizes in prop::collection::vec(1u64..=4, 3),
    ) {
        let mesh_shape = &sizes[..placements.len()];
        let layout = fit_blocks(&[n], Layout::new(contiguous(mesh_shape), placements));
        for &rank in layout.mesh.ranks() {
            prop_assert_eq!(
                crate_lists(&[n], &layout, rank),
                oracle::local_index_lists(&[n], &layout, rank),
                "rank {}", rank
            );
        }
    }

    #[test]
    fn replicas_are_the_ranks_sharing_a_shard((shape, layout) in shaped_layout(64)) {
        let shard_axes: Vec<Vec<usize>> = (0..shape.len())
            .map(|d| (0..layout.placements.len())
                .filter(|&a| match layout.placements[a] {
                    Placement::Replicate => false,
                    Placement::Shard(dim)
                    | Placement::StridedShard { dim, .. }
                    | Placement::ShardBlocks { dim, .. } => dim == d,
                })
                .collect())
            .collect();
        for &rank in layout.mesh.ranks() {
            let coord = oracle::coordinate(&layout, rank).expect("rank of the mesh");
            let per_dim: Vec<Vec<u64>> =
                shard_axes.iter().map(|axes| axes.iter().map(|&a| coord[a]).collect()).collect();
            let refs: Vec<&[u64]> = per_dim.iter().map(Vec::as_slice).collect();
            let want: Vec<u32> = layout.mesh.ranks().iter().copied().filter(|&other| {
                let c = oracle::coordinate(&layout, other).expect("rank of the mesh");
                shard_axes.iter().flatten().all(|&a| c[a] == coord[a])
            }).collect();
            prop_assert_eq!(layout.replicas(&refs), want, "rank {}", rank);
        }
    }

    #[test]
    fn view_geometry_matches_oracle(
        local_shape in prop::collection::vec(0u64..=5, 0..=5),
        recipe in prop::option::of(stride_recipe()),
        elem_size in prop::sample::select(vec![1u32, 2, 4, 8]),
    ) {
        let strides = recipe.as_ref().map(|r: &StrideRecipe| r.strides(&local_shape));
        let mut layout = Layout::new(contiguous(&[1]), vec![Placement::Replicate]);
        layout.strides = strides.clone();
        // The tensor is the view itself on a one-rank mesh, so the recipe's strides must be
        // accepted.
        let dtype = match elem_size { 1 => DType::Int8, 2 => DType::Bfloat16, 4 => DType::Float32, _ => DType::Float64 };
        let tensor = spec(&local_shape, dtype, layout.clone(), layout.clone());
        prop_assert!(tensor.validate().is_ok(), "{:?}", tensor.validate());
        let view = layout.view(&local_shape, elem_size);
        let es = u64::from(elem_size);
        prop_assert_eq!(
            view.extent_bytes(),
            oracle::view_extent_bytes(&local_shape, strides.as_deref(), es)
        );
        let mut seen = std::collections::HashSet::new();
        for linear in 0..oracle::element_count(&local_shape) {
            let pos = oracle::multi_index(&local_shape, linear);
            let want = oracle::local_byte_offset(&local_shape, strides.as_deref(), es, &pos);
            prop_assert_eq!(view.byte_offset(&pos), want, "position {:?}", pos);
            prop_assert!(want + es <= view.extent_bytes());
            prop_assert!(seen.insert(want), "two elements at byte {}", want);
        }
    }
}

// torch's documented examples, checked against both the oracle and the crate.

fn rows_of(shape: &[u64], layout: &Layout, rank: u32) -> Vec<u64> {
    let want = oracle::local_index_lists(shape, layout, rank).expect("rank of the mesh");
    let got = crate_lists(shape, layout, rank).expect("rank of the mesh");
    assert_eq!(got, want, "rank {rank}");
    want[0].clone()
}

fn shard_sizes(n: u64, parts: u64) -> Vec<usize> {
    let layout = Layout::new(contiguous(&[parts]), vec![Placement::Shard(0)]);
    (0..parts as u32)
        .map(|r| rows_of(&[n], &layout, r).len())
        .collect()
}

#[test]
fn uneven_shards_follow_torch_chunk() {
    assert_eq!(shard_sizes(5, 4), [2, 2, 1, 0]);
    assert_eq!(shard_sizes(6, 4), [2, 2, 2, 0]);
    assert_eq!(shard_sizes(7, 4), [2, 2, 2, 1]);
    assert_eq!(shard_sizes(0, 3), [0, 0, 0]);
    assert_eq!(shard_sizes(1, 3), [1, 0, 0]);
}

#[test]
fn ten_rows_on_two_by_two_shard_shard() {
    let layout = Layout::new(
        contiguous(&[2, 2]),
        vec![Placement::Shard(0), Placement::Shard(0)],
    );
    let rows: Vec<Vec<u64>> = (0..4).map(|r| rows_of(&[10, 3], &layout, r)).collect();
    assert_eq!(rows, [vec![0, 1, 2], vec![3, 4], vec![5, 6, 7], vec![8, 9]]);
}

#[test]
fn eight_rows_strided_shard_is_right_to_left() {
    let mesh = mesh_of(&[2, 2], &[0, 1, 2, 3]);
    let strided = Layout::new(
        mesh.clone(),
        vec![
            Placement::StridedShard {
                dim: 0,
                split_factor: 2,
            },
            Placement::Shard(0),
        ],
    );
    let rows: Vec<Vec<u64>> = (0..4).map(|r| rows_of(&[8, 8], &strided, r)).collect();
    assert_eq!(rows, [vec![0, 1], vec![4, 5], vec![2, 3], vec![6, 7]]);

    let plain = Layout::new(mesh, vec![Placement::Shard(0), Placement::Shard(0)]);
    let rows: Vec<Vec<u64>> = (0..4).map(|r| rows_of(&[8, 8], &plain, r)).collect();
    assert_eq!(rows, [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
}

#[test]
fn strided_shard_of_uneven_rows_takes_a_chunk_of_every_piece() {
    // torch: chunk 5 rows into 2 pieces ([0,1,2], [3,4]), chunk each over 2 ranks.
    let layout = Layout::new(
        contiguous(&[2]),
        vec![Placement::StridedShard {
            dim: 0,
            split_factor: 2,
        }],
    );
    assert_eq!(rows_of(&[5], &layout, 0), [0, 1, 3]);
    assert_eq!(rows_of(&[5], &layout, 1), [2, 4]);
}

#[test]
fn split_factors_beyond_the_dim_leave_one_row_per_piece() {
    // torch.chunk(7 rows, 1000) gives 7 one-row pieces and 993 empty ones; each piece chunked
    // over 2 ranks goes to coordinate 0.
    for split_factor in [7, 8, 1000] {
        let layout = Layout::new(
            contiguous(&[2]),
            vec![Placement::StridedShard {
                dim: 0,
                split_factor,
            }],
        );
        assert_eq!(rows_of(&[7], &layout, 0), [0, 1, 2, 3, 4, 5, 6]);
        assert!(rows_of(&[7], &layout, 1).is_empty());
    }
    // Too large for the oracle to enumerate; the crate must agree with the same closed form.
    let layout = Layout::new(
        contiguous(&[2]),
        vec![Placement::StridedShard {
            dim: 0,
            split_factor: u64::MAX,
        }],
    );
    assert_eq!(crate_lists(&[7], &layout, 0), Some(vec![(0..7).collect()]));
    assert_eq!(crate_lists(&[7], &layout, 1), Some(vec![vec![]]));
    let t = spec(&[7], DType::Float32, layout, replicated(3));
    assert!(t.validate().is_ok(), "{:?}", t.validate());
}

#[test]
fn coordinates_follow_a_non_contiguous_rank_table() {
    // Rank 7 sits at row-major position 1 → coordinate (0, 1) → rows 2..4 of 8 over a 2×2
    // [Shard(0), Shard(0)] mesh.
    let layout = Layout::new(
        mesh_of(&[2, 2], &[3, 7, 0, 5]),
        vec![Placement::Shard(0), Placement::Shard(0)],
    );
    assert_eq!(rows_of(&[8], &layout, 7), [2, 3]);
    assert_eq!(rows_of(&[8], &layout, 0), [4, 5]);
    assert_eq!(layout.rank_indices(&[8], 1), None);
    assert_eq!(oracle::local_index_lists(&[8], &layout, 1), None);
}

// Bad descriptors: an error naming the field, never a panic.

fn assert_err_mentions<T: std::fmt::Debug>(result: ncclreshard::Result<T>, words: &[&str]) {
    match result {
        Ok(v) => panic!("expected an error mentioning {words:?}, got Ok({v:?})"),
        Err(e) => {
            for w in words {
                assert!(
                    e.message.contains(w),
                    "error {:?} does not mention {w:?}",
                    e.message
                );
            }
        }
    }
}

fn plan(tensors: Vec<TensorSpec>) -> ncclreshard::Result<Planner> {
    Planner::new(tensors, Config::default())
}

#[test]
fn placement_dim_out_of_range_is_an_error() {
    let bad = Layout::new(contiguous(&[2]), vec![Placement::Shard(2)]);
    let t = spec(&[4, 4], DType::Float32, bad, replicated(2));
    assert_err_mentions(t.validate(), &["src", "placements[0]", "dim 2"]);
    assert_err_mentions(plan(vec![t]), &["tensors[0]", "src", "placements[0]"]);

    let bad = Layout::new(
        contiguous(&[2]),
        vec![Placement::StridedShard {
            dim: 0,
            split_factor: 2,
        }],
    );
    let t = spec(&[], DType::Int8, replicated(2), bad);
    assert_err_mentions(
        plan(vec![
            spec(&[1], DType::Int8, replicated(1), replicated(1)),
            t,
        ]),
        &["tensors[1]", "dst", "placements[0]"],
    );
}

#[test]
fn placement_count_must_match_mesh_axes() {
    let bad = Layout::new(contiguous(&[2, 2]), vec![Placement::Shard(0)]);
    let t = spec(&[4], DType::Float32, bad.clone(), replicated(1));
    assert_err_mentions(t.validate(), &["src", "placements", "2 axes"]);
    let t = spec(&[4], DType::Float32, replicated(1), bad);
    assert_err_mentions(plan(vec![t]), &["tensors[0]", "dst", "placements"]);
}

#[test]
fn bad_meshes_are_errors() {
    assert_err_mentions(Mesh::new(vec![2, 0], vec![]), &["axis 1", "size 0"]);
    assert_err_mentions(Mesh::new(vec![3], vec![4, 1, 4]), &["rank 4", "twice"]);
    assert_err_mentions(Mesh::new(vec![2, 2], vec![0, 1, 2]), &["rank table"]);
    assert_err_mentions(Mesh::new(vec![], vec![]), &["axes"]);
    assert_err_mentions(Mesh::new(vec![1; 9], vec![0]), &["axes"]);
    assert_err_mentions(Mesh::contiguous(vec![2], u32::MAX), &["rank"]);
    assert_err_mentions(Mesh::new(vec![1 << 32, 1 << 32], vec![0]), &["rank table"]);
}

#[test]
fn split_factor_zero_is_an_error() {
    let bad = Layout::new(
        contiguous(&[2]),
        vec![Placement::StridedShard {
            dim: 0,
            split_factor: 0,
        }],
    );
    let t = spec(&[4], DType::Float32, bad, replicated(1));
    assert_err_mentions(t.validate(), &["src", "split_factor"]);
    assert_err_mentions(plan(vec![t]), &["tensors[0]", "split_factor"]);
}

#[test]
fn overlapping_strides_are_an_error() {
    let bad = replicated(1).with_strides(vec![1, 1]);
    let t = spec(&[4, 4], DType::Float32, replicated(1), bad);
    assert_err_mentions(t.validate(), &["dst", "strides"]);
    assert_err_mentions(plan(vec![t]), &["tensors[0]", "dst", "strides"]);

    // Strides that only overlap on the largest shard are caught too.
    let bad = Layout::new(contiguous(&[2]), vec![Placement::Shard(1)]).with_strides(vec![2, 1]);
    let t = spec(&[3, 5], DType::Int8, bad, replicated(1));
    assert_err_mentions(t.validate(), &["src", "strides"]);

    let bad = replicated(1).with_strides(vec![1]);
    let t = spec(&[4, 4], DType::Float32, bad, replicated(1));
    assert_err_mentions(t.validate(), &["src", "strides", "entries"]);

    // Transposed and padded views are fine.
    let ok = replicated(1).with_strides(vec![1, 5]);
    assert!(spec(&[4, 4], DType::Float32, replicated(1), ok)
        .validate()
        .is_ok());
}

#[test]
fn sizes_overflowing_64_bits_are_errors() {
    let huge = [1u64 << 32, 1 << 32];
    let t = spec(&huge, DType::Float32, replicated(1), replicated(1));
    assert_err_mentions(t.validate(), &["shape"]);
    assert_err_mentions(plan(vec![t]), &["tensors[0]", "shape"]);

    // Elements fit, bytes do not.
    let t = spec(&[1 << 62], DType::Float64, replicated(1), replicated(1));
    assert_err_mentions(t.validate(), &["shape"]);

    // The view's strides reach past 64 bits.
    let far = replicated(1).with_strides(vec![1 << 62, 1]);
    let t = spec(&[8, 2], DType::Float32, replicated(1), far);
    assert_err_mentions(t.validate(), &["dst"]);
}

#[test]
fn bad_config_and_placements_are_errors() {
    let t = spec(&[4], DType::Float32, replicated(1), replicated(1));
    let config = Config {
        topology: Topology::RanksPerNode(0),
        ..Default::default()
    };
    assert_err_mentions(Planner::new(vec![t.clone()], config), &["ranks_per_node"]);
    let config = Config {
        split_min_bytes: 0,
        ..Default::default()
    };
    assert_err_mentions(Planner::new(vec![t], config), &["split_min_bytes"]);
    assert_err_mentions(Placement::parse("Partial()"), &["Partial"]);
    assert_err_mentions(Placement::parse("Shard(x)"), &["Shard(x)"]);
    let too_many = spec(&[1; 9], DType::Float32, replicated(1), replicated(1));
    assert_err_mentions(too_many.validate(), &["shape", "9 dims"]);
}
