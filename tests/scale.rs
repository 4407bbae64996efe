//! Plans for tensors past 32-bit sizes (over 2^31 elements, over 4 GiB per rank) keep every
//! offset exact; plans are shared safely across threads. Sparse checks: no host buffers of
//! that size are allocated.

use ncclreshard::ffi::*;
use ncclreshard::plan::{Buffer, StridedCopy};
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, Planner, TensorSpec};
use std::os::raw::c_int;

fn layout(shape: &[u64], ranks: &[u32], placements: &[Placement]) -> Layout {
    Layout::new(
        Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap(),
        placements.to_vec(),
    )
}

/// Moves one element through a copy's geometry: the byte offsets of element `i` (in copy
/// order) on both sides.
fn nth(copy: &StridedCopy, mut i: u64, elem: u64) -> (u64, u64) {
    let per_chunk = copy.chunk_bytes / elem;
    let within = (i % per_chunk) * elem;
    i /= per_chunk;
    let (mut s, mut d) = (copy.src.offset + within, copy.dst.offset + within);
    for dim in copy.dims.iter().rev() {
        s += (i % dim.count) * dim.src_stride;
        d += (i % dim.count) * dim.dst_stride;
        i /= dim.count;
    }
    (s, d)
}

#[test]
fn offsets_past_four_gib_are_exact() {
    // [3·2^31 + 5, 3] bfloat16 (≈ 38 GiB): rows Shard(0) over 2 → Shard(0) over 3 on other
    // ranks. Each rank holds > 2^31 elements and > 4 GiB.
    let rows: u64 = 3 * (1 << 31) + 5;
    let spec = TensorSpec {
        shape: vec![rows, 3],
        dtype: DType::Bfloat16,
        src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
        dst: layout(&[3], &[2, 3, 4], &[Placement::Shard(0)]),
    };
    for mode in [Mode::Groupable, Mode::Staged] {
        let planner = Planner::new(
            vec![spec.clone()],
            Config {
                mode,
                ..Default::default()
            },
        )
        .unwrap();
        let half = rows.div_ceil(2);
        let third = rows.div_ceil(3);
        let mut received = 0u64;
        for rank in 2..5u32 {
            let blocks = planner.rank_blocks(rank).unwrap();
            for b in &blocks {
                // The global row of the box's first element, its position on both ranks.
                let first_row = b.start[0];
                let (s, d) = nth(&b.copy, 0, 2);
                assert_eq!(
                    s,
                    (first_row - u64::from(b.from) * half) * 6,
                    "source offset of row {first_row}"
                );
                assert_eq!(
                    d,
                    (first_row - u64::from(rank - 2) * third) * 6,
                    "dest offset of row {first_row}"
                );
                let last = b.copy.bytes() / 2 - 1;
                let (s, d) = nth(&b.copy, last, 2);
                let last_row = first_row + b.count[0] - 1;
                assert_eq!(s, (last_row - u64::from(b.from) * half) * 6 + 4);
                assert_eq!(d, (last_row - u64::from(rank - 2) * third) * 6 + 4);
                received += b.copy.bytes();
            }
            let program = planner.rank_program(rank).unwrap();
            assert_eq!(
                program.bytes_received(),
                blocks.iter().map(|b| b.copy.bytes()).sum::<u64>()
            );
            if mode == Mode::Staged {
                assert!(program
                    .recvs
                    .iter()
                    .all(|m| m.loc.buffer != Buffer::Staging || m.bytes > 1 << 32));
            }
        }
        assert_eq!(received, rows * 3 * 2);
    }
}

#[test]
fn more_than_two_billion_elements_in_one_dim() {
    // A 1-D int8 tensor of 2^33 + 3 elements: StridedShard and uneven chunks at 64-bit sizes.
    let n: u64 = (1 << 33) + 3;
    let spec = TensorSpec {
        shape: vec![n],
        dtype: DType::Int8,
        src: layout(
            &[2, 2],
            &[0, 1, 2, 3],
            &[
                Placement::StridedShard {
                    dim: 0,
                    split_factor: 2,
                },
                Placement::Shard(0),
            ],
        ),
        dst: layout(&[3], &[4, 5, 6], &[Placement::Shard(0)]),
    };
    let planner = Planner::new(vec![spec.clone()], Config::default()).unwrap();
    let mut total = 0;
    for rank in 4..7u32 {
        let blocks = planner.rank_blocks(rank).unwrap();
        let mut covered: Vec<(u64, u64)> = blocks
            .iter()
            .map(|b| (b.start[0], b.start[0] + b.count[0]))
            .collect();
        covered.sort_unstable();
        // The rank's destination rows, exactly once.
        let chunk = n.div_ceil(3);
        let (lo, hi) = (
            u64::from(rank - 4) * chunk,
            (u64::from(rank - 3) * chunk).min(n),
        );
        assert_eq!(covered.first().unwrap().0, lo);
        assert_eq!(covered.last().unwrap().1, hi);
        assert!(
            covered.windows(2).all(|w| w[0].1 == w[1].0),
            "gaps or overlaps: {covered:?}"
        );
        for b in &blocks {
            assert_eq!(
                b.copy.dst.offset,
                b.start[0] - lo,
                "destination offset of {}",
                b.start[0]
            );
        }
        total += hi - lo;
    }
    assert_eq!(total, n);
}

fn c_layout(
    first: c_int,
    size: i64,
    kind: ncclReshardPlacementKind_t,
    dim: c_int,
) -> ncclReshardLayout_t {
    let mut l = ncclReshardLayout_t {
        size: std::mem::size_of::<ncclReshardLayout_t>(),
        version: NCCL_RESHARD_VERSION_CODE as u32,
        meshNdim: 1,
        meshShape: [0; 8],
        ranks: std::ptr::null(),
        firstRank: first,
        placements: [ncclReshardPlacement_t::default(); 8],
        strides: std::ptr::null(),
    };
    l.meshShape[0] = size;
    l.placements[0] = ncclReshardPlacement_t {
        kind: kind as c_int,
        dim,
        splitFactor: 0,
    };
    l
}

#[test]
fn plans_are_created_queried_and_destroyed_from_many_threads() {
    let src = c_layout(0, 4, ncclReshardPlacementKind_t::ncclReshardShard, 1);
    let dst = c_layout(4, 2, ncclReshardPlacementKind_t::ncclReshardShard, 0);
    let tensor = ncclReshardTensor_t {
        size: std::mem::size_of::<ncclReshardTensor_t>(),
        version: NCCL_RESHARD_VERSION_CODE as u32,
        ndim: 2,
        shape: [512, 384, 0, 0, 0, 0, 0, 0],
        dtype: 9,
        src: &src,
        dst: &dst,
        srcOffset: 0,
        dstOffset: 0,
        name: std::ptr::null(),
        dstDtype: NCCL_RESHARD_UNDEF_INT,
        quant: std::ptr::null(),
        scaleOffset: 0,
    };
    // One shared plan queried by every thread while each also creates and destroys its own.
    let mut shared: ncclReshardPlan_t = std::ptr::null_mut();
    // SAFETY: valid descriptors and out-pointer.
    assert_eq!(
        unsafe { ncclReshardPlanCreate(&mut shared, 1, &tensor, 4, std::ptr::null()) },
        0
    );
    let shared_addr = shared as usize;
    let tensor_addr = &tensor as *const ncclReshardTensor_t as usize;
    std::thread::scope(|scope| {
        for thread in 0..8 {
            scope.spawn(move || {
                let shared = shared_addr as ncclReshardPlan_t;
                let tensor = tensor_addr as *const ncclReshardTensor_t;
                for i in 0..50 {
                    let rank = ((thread + i) % 6) as c_int;
                    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
                    // SAFETY: descriptors outlive the scope; handles are used per the API.
                    unsafe {
                        assert_eq!(
                            ncclReshardPlanCreate(&mut plan, 1, tensor, rank, std::ptr::null()),
                            0
                        );
                        let mut info = ncclReshardPlanInfo_t {
                            size: std::mem::size_of::<ncclReshardPlanInfo_t>(),
                            ..Default::default()
                        };
                        assert_eq!(ncclReshardPlanGetInfo(plan, &mut info), 0);
                        assert_eq!(info.rank, rank);
                        let mut shared_info = ncclReshardPlanInfo_t {
                            size: std::mem::size_of::<ncclReshardPlanInfo_t>(),
                            ..Default::default()
                        };
                        assert_eq!(ncclReshardPlanGetInfo(shared, &mut shared_info), 0);
                        assert_eq!(shared_info.fingerprint, info.fingerprint);
                        let mut count = 0;
                        assert_eq!(
                            ncclReshardPlanGetTransfers(
                                shared,
                                std::ptr::null_mut(),
                                0,
                                &mut count
                            ),
                            0
                        );
                        assert!(count > 0);
                        // A failing call on this thread leaves its own last error only.
                        assert_eq!(ncclReshardGetVersion(std::ptr::null_mut()), 4);
                        assert_eq!(ncclReshardPlanDestroy(plan), 0);
                    }
                }
            });
        }
    });
    // SAFETY: the shared plan is no longer used.
    assert_eq!(unsafe { ncclReshardPlanDestroy(shared) }, 0);
}

#[test]
fn host_checks_run_concurrently() {
    let spec = TensorSpec {
        shape: vec![96, 40],
        dtype: DType::Float32,
        src: layout(
            &[2, 2],
            &[0, 1, 2, 3],
            &[Placement::Replicate, Placement::Shard(1)],
        ),
        dst: layout(&[3], &[3, 4, 5], &[Placement::Shard(0)]),
    };
    std::thread::scope(|scope| {
        for mode in [Mode::Groupable, Mode::Staged, Mode::Auto, Mode::Groupable] {
            let spec = spec.clone();
            scope.spawn(move || {
                for _ in 0..10 {
                    ncclreshard_tools::check::check(
                        std::slice::from_ref(&spec),
                        &Config {
                            mode,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                }
            });
        }
    });
}

#[test]
fn absurd_descriptors_are_refused_before_allocating() {
    // A mesh of 2^30 ranks (4 GiB of rank table) and a StridedShard cutting 2^40 rows into 2^40
    // pieces would each take unbounded memory or time: both are errors, at once.
    let err = Mesh::contiguous(vec![1 << 30], 0).unwrap_err();
    assert!(err.message.contains("rank table"), "{err}");
    let spec = TensorSpec {
        shape: vec![1 << 40],
        dtype: DType::Int8,
        src: layout(
            &[2],
            &[0, 1],
            &[Placement::StridedShard {
                dim: 0,
                split_factor: 1 << 40,
            }],
        ),
        dst: layout(&[1], &[2], &[Placement::Replicate]),
    };
    let started = std::time::Instant::now();
    let err = Planner::new(vec![spec], Config::default()).unwrap_err();
    assert!(err.message.contains("pieces"), "{err}");
    assert!(started.elapsed().as_secs() < 5);
}
