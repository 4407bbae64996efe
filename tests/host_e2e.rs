//! End to end on the host executor (docs/design.md §7 step 2), verified only through the oracle: every
//! rank's buffers are filled and checked from the oracle's index lists and view geometry, never
//! from the crate's layout code.

mod oracle;

use ncclreshard::exec::{NoLimits, Plan, PlanTensor, StagingLimit};
use ncclreshard::plan::{Buffer, ExecMode, Message, GROUPABLE_MAX_MESSAGES_PER_RANK};
use ncclreshard::transport::host::{execute, RankBuffers};
use ncclreshard::{
    Config, DType, Layout, Mesh, Mode, Placement, Planner, RankProgram, TensorSpec, Topology,
};
use oracle::strategies::{layout_on, mesh, tensor_on};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// Bytes past the end of every destination view: a program writing beyond the view's extent
/// shows up as a changed sentinel. Source buffers are exactly the extent, so an out-of-view
/// read is an executor error.
const DST_SLACK: usize = 16;

const SRC_SIDE: u8 = 0;
const DST_SIDE: u8 = 1;

/// A rank's local tensor on one side, as the oracle sees it.
struct OracleView {
    lists: Vec<Vec<u64>>,
    local_shape: Vec<u64>,
    strides: Option<Vec<u64>>,
    elem_size: u64,
}

impl OracleView {
    fn of(spec: &TensorSpec, layout: &Layout, rank: u32) -> Option<OracleView> {
        let lists = oracle::local_index_lists(&spec.shape, layout, rank)?;
        let local_shape = lists.iter().map(|l| l.len() as u64).collect();
        Some(OracleView {
            lists,
            local_shape,
            strides: layout.strides.clone(),
            elem_size: u64::from(spec.dtype.size()),
        })
    }

    fn extent(&self) -> usize {
        oracle::view_extent_bytes(&self.local_shape, self.strides.as_deref(), self.elem_size)
            as usize
    }

    fn elements(&self) -> u64 {
        oracle::element_count(&self.local_shape)
    }

    /// Calls `f(byte offset, global linear index)` for every element of the view.
    fn for_each(&self, shape: &[u64], mut f: impl FnMut(usize, u64)) {
        oracle::for_each_local_element(&self.lists, |pos, global| {
            let offset = oracle::local_byte_offset(
                &self.local_shape,
                self.strides.as_deref(),
                self.elem_size,
                pos,
            );
            f(offset as usize, oracle::linear_index(shape, global));
        });
    }

    /// The buffer's full content: sentinels, with every element's value where it lives.
    fn image(&self, shape: &[u64], tensor: usize, rank: u32, side: u8, len: usize) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..len)
            .map(|o| oracle::sentinel_byte(rank, tensor, side, o))
            .collect();
        let size = self.elem_size as usize;
        self.for_each(shape, |offset, global| {
            bytes[offset..offset + size]
                .copy_from_slice(&oracle::element_bytes(tensor, global, size));
        });
        bytes
    }
}

/// Every rank in any mesh, ascending, by the oracle.
fn all_ranks(tensors: &[TensorSpec]) -> Vec<u32> {
    let mut ranks: Vec<u32> = tensors
        .iter()
        .flat_map(|t| {
            oracle::mesh_ranks(&t.src)
                .into_iter()
                .chain(oracle::mesh_ranks(&t.dst))
        })
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

fn initial_buffers(tensors: &[TensorSpec], ranks: &[u32]) -> Vec<RankBuffers> {
    ranks
        .iter()
        .map(|&rank| {
            let mut memory = RankBuffers::default();
            for (t, spec) in tensors.iter().enumerate() {
                memory
                    .src
                    .push(match OracleView::of(spec, &spec.src, rank) {
                        Some(v) => v.image(&spec.shape, t, rank, SRC_SIDE, v.extent()),
                        None => Vec::new(),
                    });
                memory
                    .dst
                    .push(match OracleView::of(spec, &spec.dst, rank) {
                        Some(v) => (0..v.extent() + DST_SLACK)
                            .map(|o| oracle::sentinel_byte(rank, t, DST_SIDE, o))
                            .collect(),
                        None => Vec::new(),
                    });
            }
            memory
        })
        .collect()
}

/// Says which element (if any) of a view lives at `offset`, for failure messages.
fn describe_byte(view: &OracleView, shape: &[u64], offset: usize) -> String {
    let size = view.elem_size as usize;
    let mut found = None;
    view.for_each(shape, |at, global| {
        if (at..at + size).contains(&offset) {
            found = Some(global);
        }
    });
    match found {
        Some(global) => format!("inside the element with global index {global}"),
        None => "outside every element of the view".to_string(),
    }
}

/// Checks every buffer after `execute` against the oracle.
fn verify(tensors: &[TensorSpec], ranks: &[u32], before: &[RankBuffers], after: &[RankBuffers]) {
    for (i, &rank) in ranks.iter().enumerate() {
        for (t, spec) in tensors.iter().enumerate() {
            assert!(
                after[i].src[t] == before[i].src[t],
                "rank {rank} tensor {t}: source changed"
            );
            let got = &after[i].dst[t];
            let Some(view) = OracleView::of(spec, &spec.dst, rank) else {
                assert!(got.is_empty(), "rank {rank} tensor {t}: has no destination");
                continue;
            };
            let want = view.image(&spec.shape, t, rank, DST_SIDE, view.extent() + DST_SLACK);
            assert_eq!(
                got.len(),
                want.len(),
                "rank {rank} tensor {t}: buffer resized"
            );
            if let Some(offset) = (0..want.len()).find(|&o| got[o] != want[o]) {
                panic!(
                    "rank {rank} tensor {t} ({:?} {:?}, dst {:?} strides {:?}): byte {offset} \
                     ({}) is {:#04x}, expected {:#04x}",
                    spec.shape,
                    spec.dtype,
                    spec.dst.placements,
                    spec.dst.strides,
                    describe_byte(&view, &spec.shape, offset),
                    got[offset],
                    want[offset]
                );
            }
        }
    }
}

/// Checks what the programs claim to move against what the oracle says must move: every
/// destination element arrives exactly once, and a rank's own overlap is a local copy.
fn verify_accounting(tensors: &[TensorSpec], ranks: &[u32], programs: &[RankProgram]) {
    for (&rank, program) in ranks.iter().zip(programs) {
        let mut must_arrive = 0u64;
        let mut own = 0u64;
        for spec in tensors {
            let Some(dst) = OracleView::of(spec, &spec.dst, rank) else {
                continue;
            };
            must_arrive += dst.elements() * dst.elem_size;
            if let Some(src) = OracleView::of(spec, &spec.src, rank) {
                let common: u64 = src
                    .lists
                    .iter()
                    .zip(&dst.lists)
                    .map(|(a, b)| a.iter().filter(|i| b.contains(i)).count() as u64)
                    .product();
                own += common * dst.elem_size;
            }
        }
        // A rank's own overlap moves by local copies, or by messages to itself when the
        // config routes it through the transport.
        let to_self: u64 = program
            .recvs
            .iter()
            .filter(|m| m.peer == rank)
            .map(|m| m.bytes)
            .sum();
        assert_eq!(
            program.bytes_copied_locally() + to_self,
            own,
            "rank {rank}: local copies (or self messages) should cover exactly its own overlap"
        );
        assert_eq!(
            program.bytes_received() + program.bytes_copied_locally(),
            must_arrive,
            "rank {rank}: bytes received + copied locally vs its destination bytes"
        );
    }
}

/// What the mode promises about the shape of every program.
fn verify_mode(mode: Mode, programs: &[RankProgram]) {
    for p in programs {
        match mode {
            Mode::Groupable => {
                // Nothing a second call in the same NCCL group could overwrite: no staging.
                assert!(
                    p.unpacks.is_empty() && p.packs.is_empty() && p.staging_bytes == 0,
                    "rank {}: groupable plan packs, unpacks or stages",
                    p.rank
                );
                assert_eq!(p.mode(), ExecMode::Groupable);
                for m in &p.recvs {
                    assert_eq!(
                        m.loc.buffer,
                        Buffer::Dst,
                        "rank {}: groupable receive into {:?}",
                        p.rank,
                        m.loc.buffer
                    );
                }
                for m in &p.sends {
                    assert_eq!(
                        m.loc.buffer,
                        Buffer::Src,
                        "rank {}: groupable send from {:?}",
                        p.rank,
                        m.loc.buffer
                    );
                }
            }
            Mode::Staged => {
                for round in p.rounds() {
                    for messages in [round.sends, round.recvs] {
                        let mut peers: Vec<u32> = messages.iter().map(|m| m.peer).collect();
                        peers.sort_unstable();
                        let n = peers.len();
                        peers.dedup();
                        assert_eq!(
                            peers.len(),
                            n,
                            "rank {}: staged pair with several messages in round {}",
                            p.rank,
                            round.round
                        );
                    }
                }
            }
            Mode::Auto => {}
        }
    }
}

/// Plans every rank, runs all of them on the host executor and checks everything against the
/// oracle. Returns the programs for further assertions.
///
/// Groupable mode may refuse a rank that would need more than
/// `GROUPABLE_MAX_MESSAGES_PER_RANK` messages (regions interleaved element by element); then
/// the case is checked in auto mode instead, which must take it.
fn run_checked(tensors: &[TensorSpec], config: &Config) -> Vec<RankProgram> {
    let planner = Planner::new(tensors.to_vec(), config.clone())
        .unwrap_or_else(|e| panic!("plan rejected: {e}"));
    let ranks = planner.ranks();
    assert_eq!(ranks, all_ranks(tensors), "planner.ranks()");
    let planned: Result<Vec<RankProgram>, _> =
        ranks.iter().map(|&r| planner.rank_program(r)).collect();
    let programs = match planned {
        Ok(programs) => programs,
        Err(e)
            if config.mode == Mode::Groupable
                && e.message.contains(&format!(
                    "groupable mode needs more than {GROUPABLE_MAX_MESSAGES_PER_RANK} messages"
                )) =>
        {
            let auto = Config {
                mode: Mode::Auto,
                ..config.clone()
            };
            return run_checked(tensors, &auto);
        }
        Err(e) => panic!("{e}"),
    };
    for (&r, p) in ranks.iter().zip(&programs) {
        assert_eq!(p.rank, r);
        assert_eq!(p.fingerprint, programs[0].fingerprint);
    }
    let before = initial_buffers(tensors, &ranks);
    let mut buffers = before.clone();
    execute(&programs, &mut buffers).unwrap_or_else(|e| panic!("execute: {e}"));
    verify(tensors, &ranks, &before, &buffers);
    verify_accounting(tensors, &ranks, &programs);
    verify_mode(config.mode, &programs);
    programs
}

// Random cases.

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![
        DType::Int8,
        DType::Float16,
        DType::Bfloat16,
        DType::Float32,
        DType::Float64,
    ])
}

/// Rank 0..=4 with dims 0..=12, rank 1..=2 with dims up to 48, rank 8 with dims 1..=3, or
/// rank 5..=7 with dims 0..=3.
fn e2e_shape() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        6 => prop::collection::vec(0u64..=12, 0..=4),
        1 => prop::collection::vec(0u64..=48, 1..=2),
        1 => prop::collection::vec(1u64..=3, 8),
        1 => prop::collection::vec(0u64..=3, 5..=7),
    ]
}

/// The destination mesh relative to the source one: any mesh over the same small rank pool
/// (partially overlapping or not), the source's own ranks reshaped and shuffled (colocated),
/// or ranks disjoint from every source.
fn dst_mesh(src: Mesh) -> BoxedStrategy<Mesh> {
    let ranks = src.ranks().to_vec();
    let n = ranks.len() as u64;
    let shapes: Vec<Vec<u64>> = std::iter::once(vec![n])
        .chain((2..n).filter(|a| n % a == 0).map(|a| vec![a, n / a]))
        .chain(std::iter::once(src.shape().to_vec()))
        .collect();
    let colocated = (prop::sample::select(shapes), Just(ranks).prop_shuffle())
        .prop_map(|(shape, ranks)| Mesh::new(shape, ranks).expect("valid mesh"));
    let disjoint = mesh(3, 4, 16, 4).prop_map(|m| {
        Mesh::new(
            m.shape().to_vec(),
            m.ranks().iter().map(|r| r + 40).collect(),
        )
        .expect("valid mesh")
    });
    prop_oneof![
        2 => mesh(3, 4, 16, 4),
        2 => colocated,
        1 => disjoint,
    ]
    .boxed()
}

fn tensor() -> impl Strategy<Value = TensorSpec> {
    (e2e_shape(), dtype(), mesh(3, 4, 16, 4)).prop_flat_map(|(shape, dtype, src_mesh)| {
        let ndim = shape.len();
        let src = layout_on(src_mesh.clone(), ndim);
        let dst = dst_mesh(src_mesh)
            .prop_flat_map(move |m| layout_on(m, ndim))
            .boxed();
        tensor_on(shape, dtype, src, dst)
    })
}

fn mode() -> impl Strategy<Value = Mode> {
    prop::sample::select(vec![Mode::Groupable, Mode::Staged, Mode::Auto])
}

fn config(mode: impl Strategy<Value = Mode>) -> impl Strategy<Value = Config> {
    (
        mode,
        prop_oneof![
            Just(Topology::Unknown),
            (1u32..=4).prop_map(Topology::RanksPerNode),
            // A node for every rank the strategies can draw (a shorter table is rejected).
            prop::collection::vec(0u32..4, 256).prop_map(Topology::NodeTable),
        ],
        prop::sample::select(vec![1u64, 3, 64, 1 << 20]),
        // Colocated data as self-messages (the single-GPU test path) now and then.
        prop::bool::weighted(0.2),
        // Automatic rounds (one, for tensors this small) or several.
        prop::sample::select(vec![0u32, 0, 1, 2, 3, 5]),
        prop::bool::weighted(0.7),
        // The senders' barrier: the default (never, on nodes this small), on, off.
        prop::sample::select(vec![None, Some(true), Some(false)]),
    )
        .prop_map(
            |(mode, topology, split_min_bytes, local_via_messages, rounds, relay, barrier)| {
                Config {
                    mode,
                    topology,
                    split_min_bytes,
                    local_via_messages,
                    rounds,
                    relay,
                    sender_barrier: barrier,
                }
            },
        )
}

fn tensors() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop_oneof![
        3 => prop::collection::vec(tensor(), 1),
        2 => prop::collection::vec(tensor(), 2..=5),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn random_reshards_are_byte_exact(tensors in tensors(), config in config(mode())) {
        run_checked(&tensors, &config);
    }
}

/// A rank's program under a staging limit, with the programs with every late unpack (`all`)
/// and none (`none`) it lies between.
struct Limited {
    program: RankProgram,
    all: RankProgram,
    none: RankProgram,
    limit: u64,
}

/// Rank `r`'s program under a staging limit `eighths` of the way from what its program without
/// late unpacks needs to what all of them need (`Planner::rank_program_within`), checked to
/// keep within it.
fn under_staging_limit(planner: &Planner, r: u32, eighths: u64) -> Limited {
    let all = planner.rank_program(r).unwrap();
    let none = planner.rank_program_sequential(r).unwrap();
    let limit = none.staging_bytes + (all.staging_bytes - none.staging_bytes) * eighths / 8;
    let program = planner.rank_program_within(r, limit).unwrap();
    assert!(
        program.staging_bytes <= limit,
        "rank {r}: {} > {limit}",
        program.staging_bytes
    );
    Limited {
        program,
        all,
        none,
        limit,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every rank under a staging limit `eighths` of the way from what its program without
    /// late unpacks needs to what all of them need: only some of its late unpacks' receives
    /// move into the arenas, and every byte still lands.
    #[test]
    fn random_reshards_under_staging_limits_are_byte_exact(
        tensors in tensors(),
        config in config(prop::sample::select(vec![Mode::Staged, Mode::Auto])),
        eighths in 0u64..8,
    ) {
        let Ok(planner) = Planner::new(tensors.clone(), config) else {
            return Ok(());
        };
        let ranks = planner.ranks();
        let programs: Vec<RankProgram> = ranks
            .iter()
            .map(|&r| under_staging_limit(&planner, r, eighths).program)
            .collect();
        let before = initial_buffers(&tensors, &ranks);
        let mut buffers = before.clone();
        execute(&programs, &mut buffers).unwrap_or_else(|e| panic!("execute: {e}"));
        verify(&tensors, &ranks, &before, &buffers);
    }

    #[test]
    fn groupable_plans_never_unpack(
        tensors in tensors(),
        config in config(Just(Mode::Groupable)),
    ) {
        // `run_checked` asserts that no program unpacks and every receive lands in the
        // destination view.
        run_checked(&tensors, &config);
    }
}

// Fixed cases.

fn grid(shape: &[u64], first: u32) -> Mesh {
    Mesh::contiguous(shape.to_vec(), first).expect("valid mesh")
}

fn layout(mesh: Mesh, placements: &[Placement]) -> Layout {
    Layout::new(mesh, placements.to_vec())
}

fn with_mode(mode: Mode) -> Config {
    Config {
        mode,
        ..Default::default()
    }
}

const MODES: [Mode; 3] = [Mode::Groupable, Mode::Staged, Mode::Auto];

#[test]
fn local_data_can_travel_as_messages_to_self() {
    // The single-GPU test setup: Shard(1) over 2 → Replicate, all on ranks that hold both
    // sides, routed through self-messages in every mode.
    let t = TensorSpec {
        shape: vec![16, 12],
        dtype: DType::Float32,
        src: layout(grid(&[2], 0), &[Placement::Shard(1)]),
        dst: layout(grid(&[2], 0), &[Placement::Replicate]),
    };
    for mode in MODES {
        let config = Config {
            mode,
            local_via_messages: true,
            ..Default::default()
        };
        let programs = run_checked(std::slice::from_ref(&t), &config);
        let p = &programs[0];
        assert!(p.local_copies.is_empty());
        assert!(p.sends.iter().any(|m| m.peer == 0) && p.recvs.iter().any(|m| m.peer == 0));
    }
}

#[test]
fn sixty_four_ranks_8x8_to_64() {
    let t = TensorSpec {
        shape: vec![256, 256],
        dtype: DType::Float32,
        src: layout(
            grid(&[8, 8], 0),
            &[Placement::Shard(0), Placement::Shard(1)],
        ),
        dst: layout(grid(&[64], 0), &[Placement::Shard(1)]),
    };
    for mode in [Mode::Groupable, Mode::Auto] {
        let programs = run_checked(std::slice::from_ref(&t), &with_mode(mode));
        assert_eq!(programs.len(), 64);
    }
}

fn tp2_to_tp1_dim1() -> TensorSpec {
    TensorSpec {
        shape: vec![6, 10],
        dtype: DType::Float32,
        src: layout(grid(&[2], 0), &[Placement::Shard(1)]),
        dst: layout(grid(&[1], 2), &[Placement::Replicate]),
    }
}

#[test]
fn tp2_to_tp1_on_dim1_groupable_lands_directly() {
    let programs = run_checked(&[tp2_to_tp1_dim1()], &with_mode(Mode::Groupable));
    for p in &programs {
        assert!(p.unpacks.is_empty(), "rank {}", p.rank);
    }
    // Rows of the destination interleave the two sources: one message per row and source.
    assert_eq!(programs[2].recvs.len(), 12);
}

#[test]
fn tp2_to_tp1_on_dim1_staged_unpacks() {
    let programs = run_checked(&[tp2_to_tp1_dim1()], &with_mode(Mode::Staged));
    assert!(!programs[2].unpacks.is_empty());
    assert_eq!(programs[2].recvs.len(), 2, "one message per source");
    let programs = run_checked(&[tp2_to_tp1_dim1()], &with_mode(Mode::Auto));
    assert!(
        !programs[2].unpacks.is_empty(),
        "six 20-byte pieces per pair are staged in auto"
    );
}

/// DP4 × TP2 (ranks 0..8, [Replicate, Shard(0)]) → TP8 (ranks 8..16).
fn dp4_tp2_to_tp8() -> TensorSpec {
    TensorSpec {
        shape: vec![64, 64],
        dtype: DType::Float32,
        src: layout(
            grid(&[4, 2], 0),
            &[Placement::Replicate, Placement::Shard(0)],
        ),
        dst: layout(grid(&[8], 8), &[Placement::Shard(0)]),
    }
}

#[test]
fn replicated_source_spreads_the_load() {
    for config in [
        Config::default(),
        Config {
            topology: Topology::RanksPerNode(8),
            ..Default::default()
        },
    ] {
        let programs = run_checked(&[dp4_tp2_to_tp8()], &config);
        for tp in 0..2u32 {
            let replicas: Vec<u32> = (0..4).map(|dp| dp * 2 + tp).collect();
            let senders = replicas
                .iter()
                .filter(|&&r| programs[r as usize].bytes_sent() > 0)
                .count();
            assert!(
                senders > 1,
                "{config:?}: TP shard {tp} is sent by {senders} replica(s)"
            );
        }
    }
    // With small split sizes every receiver is fed by several replicas at once.
    let config = Config {
        split_min_bytes: 256,
        ..Default::default()
    };
    let programs = run_checked(&[dp4_tp2_to_tp8()], &config);
    for p in &programs[8..] {
        assert!(
            p.peers().len() > 1,
            "rank {} receives from {:?}",
            p.rank,
            p.peers()
        );
    }
}

#[test]
fn groupable_mode_never_unpacks() {
    let awkward = vec![
        tp2_to_tp1_dim1(),
        dp4_tp2_to_tp8(),
        TensorSpec {
            shape: vec![8, 6, 5],
            dtype: DType::Float16,
            src: layout(
                Mesh::new(vec![2, 2], vec![3, 0, 2, 1]).expect("valid mesh"),
                &[
                    Placement::StridedShard {
                        dim: 0,
                        split_factor: 2,
                    },
                    Placement::Shard(2),
                ],
            ),
            dst: layout(grid(&[3], 1), &[Placement::Shard(1)]).with_strides(vec![70, 1, 14]),
        },
    ];
    let programs = run_checked(&awkward, &with_mode(Mode::Groupable));
    assert!(programs.iter().all(|p| p.unpacks.is_empty()));
}

#[test]
fn scalars_and_rank_eight_tensors() {
    let scalar = TensorSpec {
        shape: vec![],
        dtype: DType::Float64,
        src: layout(grid(&[2], 0), &[Placement::Replicate]),
        dst: layout(
            grid(&[2, 2], 1),
            &[Placement::Replicate, Placement::Replicate],
        ),
    };
    let eight = TensorSpec {
        shape: vec![2, 3, 1, 2, 3, 2, 1, 3],
        dtype: DType::Bfloat16,
        src: layout(
            grid(&[2, 3], 0),
            &[Placement::Shard(7), Placement::Shard(1)],
        ),
        dst: layout(
            grid(&[3, 2], 2),
            &[Placement::Shard(4), Placement::Shard(0)],
        ),
    };
    for mode in MODES {
        run_checked(&[scalar.clone(), eight.clone()], &with_mode(mode));
    }
}

#[test]
fn padded_destination_view_keeps_the_other_half() {
    // vLLM-style fused gate_up_proj: the destination is the gate half of each row
    // (row stride 2 × 12 elements), the up half must stay untouched.
    let t = TensorSpec {
        shape: vec![16, 12],
        dtype: DType::Bfloat16,
        src: layout(grid(&[4], 0), &[Placement::Shard(1)]),
        dst: layout(grid(&[2], 4), &[Placement::Shard(0)]).with_strides(vec![24, 1]),
    };
    for mode in MODES {
        run_checked(std::slice::from_ref(&t), &with_mode(mode));
    }
}

/// Two ranks planned from slightly different tensors: rank 0 from `[4, 4]`, rank 1 from
/// `[4, 5]`, the source on rank 0 and the destination on rank 1.
fn mismatched_programs() -> (Vec<TensorSpec>, Vec<RankProgram>) {
    let a = vec![TensorSpec {
        shape: vec![4, 4],
        dtype: DType::Float32,
        src: layout(grid(&[1], 0), &[Placement::Replicate]),
        dst: layout(grid(&[1], 1), &[Placement::Replicate]),
    }];
    let mut b = a.clone();
    b[0].shape = vec![4, 5];
    let plan_a = Planner::new(a.clone(), Config::default()).expect("valid plan");
    let plan_b = Planner::new(b, Config::default()).expect("valid plan");
    let programs = vec![
        plan_a.rank_program(0).expect("program"),
        plan_b.rank_program(1).expect("program"),
    ];
    (a, programs)
}

/// Runs `execute` on its own thread and gives up after a deadline, so that a hang fails the
/// test instead of the whole run (the stuck threads are leaked). `None` means it hung.
fn execute_with_deadline(
    programs: Vec<RankProgram>,
    mut buffers: Vec<RankBuffers>,
) -> Option<ncclreshard::Result<()>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            execute(&programs, &mut buffers)
        }))
        .unwrap_or_else(|_| Err(ncclreshard::Error::internal("execute panicked")));
        let _ = tx.send(result);
    });
    rx.recv_timeout(std::time::Duration::from_secs(10)).ok()
}

#[test]
fn inconsistent_programs_are_an_error() {
    let (a, programs) = mismatched_programs();
    let buffers = initial_buffers(&a, &[0, 1]);
    match execute_with_deadline(programs, buffers) {
        None => panic!("execute hung on programs planned from different tensors"),
        Some(Ok(())) => panic!("programs planned from different tensors ran"),
        Some(Err(e)) => assert!(e.message.contains("fingerprint"), "{}", e.message),
    }
}

#[test]
fn mismatched_programs_with_forged_fingerprints_are_an_error() {
    // Even when the fingerprints agree, a size mismatch must be an error naming the ranks.
    let (a, mut programs) = mismatched_programs();
    programs[1].fingerprint = programs[0].fingerprint;
    let buffers = initial_buffers(&a, &[0, 1]);
    match execute_with_deadline(programs, buffers) {
        None => panic!("execute hung on mismatched programs"),
        Some(Ok(())) => panic!("mismatched programs ran"),
        Some(Err(e)) => assert!(
            e.message.contains("rank 0") && e.message.contains("rank 1"),
            "{}",
            e.message
        ),
    }
}

/// A rank whose program cannot run — a staging size that cannot be allocated, copy dims whose
/// byte count overflows — must make `execute` return an error naming the rank, never leave the
/// other ranks waiting at a phase barrier.
#[test]
fn a_malformed_program_is_an_error_not_a_hang() {
    let staging = RankProgram {
        rank: 0,
        staging_bytes: u64::MAX,
        ..Default::default()
    };
    let overflow = RankProgram {
        rank: 0,
        local_copies: vec![ncclreshard::plan::StridedCopy {
            src: ncclreshard::plan::Loc {
                buffer: Buffer::Src,
                tensor: 0,
                offset: 0,
            },
            dst: ncclreshard::plan::Loc {
                buffer: Buffer::Dst,
                tensor: 0,
                offset: 0,
            },
            chunk_bytes: 1,
            dims: vec![ncclreshard::plan::CopyDim {
                count: u64::MAX / 2,
                src_stride: 4,
                dst_stride: 4,
            }],
        }],
        ..Default::default()
    };
    for bad in [staging, overflow] {
        let peer = RankProgram {
            rank: 1,
            fingerprint: bad.fingerprint,
            ..Default::default()
        };
        let buffers = vec![
            RankBuffers {
                src: vec![vec![0; 8]],
                dst: vec![vec![0; 8]],
            },
            RankBuffers::default(),
        ];
        match execute_with_deadline(vec![bad.clone(), peer], buffers) {
            None => panic!("execute hung on {bad:?}"),
            Some(Ok(())) => panic!("a malformed program ran: {bad:?}"),
            Some(Err(e)) => assert!(e.message.contains("rank"), "{}", e.message),
        }
    }
}

#[test]
fn four_axis_mesh_and_zero_strides_on_unit_dims() {
    // torch allows any stride on a dim of length 1 (e.g. after `unsqueeze` or `expand`).
    let t = TensorSpec {
        shape: vec![6, 9, 1],
        dtype: DType::Float8E4M3,
        src: layout(
            Mesh::new(vec![2, 1, 2, 2], vec![7, 5, 3, 1, 6, 4, 2, 0]).expect("valid mesh"),
            &[
                Placement::Shard(0),
                Placement::Replicate,
                Placement::StridedShard {
                    dim: 1,
                    split_factor: 3,
                },
                Placement::Shard(0),
            ],
        ),
        dst: layout(grid(&[3], 2), &[Placement::Shard(1)]).with_strides(vec![3, 1, 0]),
    };
    for mode in MODES {
        run_checked(std::slice::from_ref(&t), &with_mode(mode));
    }
}

/// TP2 on ranks 0-1 → TP2 x DP4 on ranks 8-15: with 4 ranks per node, nodes 2 and 3 hold two
/// replicas of each shard.
fn tp2_to_tp2_dp4_on_two_nodes() -> TensorSpec {
    TensorSpec {
        shape: vec![64, 96],
        dtype: DType::Bfloat16,
        src: layout(grid(&[2], 0), &[Placement::Shard(1)]),
        dst: layout(
            grid(&[4, 2], 8),
            &[Placement::Replicate, Placement::Shard(0)],
        ),
    }
}

/// Four ranks per node, parts of at least 64 bytes, `rounds` rounds.
fn on_two_nodes(mode: Mode, rounds: u32) -> Config {
    Config {
        mode,
        topology: Topology::RanksPerNode(4),
        split_min_bytes: 64,
        rounds,
        ..Default::default()
    }
}

#[test]
fn replicas_on_one_node_get_network_data_once_and_relay_it() {
    let spec = tp2_to_tp2_dp4_on_two_nodes();
    let bytes_off_node = |programs: &[RankProgram]| -> u64 {
        programs
            .iter()
            .flat_map(|p| p.sends.iter().map(move |m| (p.rank, m)))
            .filter(|(from, m)| from / 4 != m.peer / 4)
            .map(|(_, m)| m.bytes)
            .sum()
    };
    for mode in [Mode::Staged, Mode::Auto] {
        for rounds in [0, 1, 3] {
            let base = on_two_nodes(mode, rounds);
            let relayed = run_checked(std::slice::from_ref(&spec), &base);
            let direct = run_checked(
                std::slice::from_ref(&spec),
                &Config {
                    relay: false,
                    ..base.clone()
                },
            );
            let tensor_bytes = 64 * 96 * 2;
            // Each of the two destination nodes needs the tensor once; without relays every
            // replica pulls its shard across the network.
            assert_eq!(bytes_off_node(&relayed), 2 * tensor_bytes, "{base:?}");
            assert_eq!(bytes_off_node(&direct), 4 * tensor_bytes, "{base:?}");
            // Every replica forwards to its node mates.
            let relay_sends: Vec<&RankProgram> = relayed
                .iter()
                .filter(|p| p.sends.iter().any(|m| m.peer / 4 == p.rank / 4))
                .collect();
            assert_eq!(relay_sends.len(), 8, "{base:?}: every replica forwards");
            assert!(relayed[2..].iter().all(|p| p.mode() == ExecMode::Staged));
        }
    }
}

/// Per round of `p`: its forwards that read the arena their data arrived in, as packs reading
/// staging and as sends reading staging that no pack of the round writes (sent as they
/// arrived; `tests/transfers.rs` checks the bytes).
fn arena_forwards(p: &RankProgram) -> Vec<(usize, usize)> {
    p.rounds()
        .iter()
        .map(|round| {
            let packed = |m: &&Message| {
                round.packs.iter().any(|c| {
                    c.dst.buffer == Buffer::Staging
                        && c.dst.offset <= m.loc.offset
                        && m.loc.offset < c.dst.offset + c.bytes()
                })
            };
            let packs = round
                .packs
                .iter()
                .filter(|c| c.src.buffer == Buffer::Staging)
                .count();
            let sends = round
                .sends
                .iter()
                .filter(|m| m.loc.buffer == Buffer::Staging)
                .filter(|m| !packed(m))
                .count();
            (packs, sends)
        })
        .collect()
}

/// A round that forwards from an arena follows a round with late unpacks (whose arena holds
/// what it forwards).
fn arena_forwards_follow_late_unpacks(p: &RankProgram, config: &Config) {
    let rounds = p.rounds();
    for (j, (packs, sends)) in arena_forwards(p).into_iter().enumerate() {
        if packs + sends > 0 {
            assert!(
                j > 0 && rounds[j - 1].late > 0,
                "{config:?} rank {}",
                p.rank
            );
        }
    }
}

#[test]
fn relays_forward_from_the_arena_their_data_arrived_in() {
    // Column shards into row shards, replicas relayed on each node: a member forwards in round
    // r + 1 column blocks of its rows that arrived in round r, strided in its destination view.
    // Where the receive they arrived in moves into a late arena, the forward packs them from
    // there, and the unpack into the destination view need not finish first (it is late).
    // Without late arenas (the sequential program) the forward packs from the destination
    // view as before. Every byte lands either way.
    let spec = tp2_to_tp2_dp4_on_two_nodes();
    for mode in [Mode::Staged, Mode::Auto] {
        for rounds in [2, 3, 4] {
            let config = on_two_nodes(mode, rounds);
            let programs = run_checked(std::slice::from_ref(&spec), &config);
            let from_arena =
                |p: &RankProgram| -> usize { arena_forwards(p).iter().map(|(a, b)| a + b).sum() };
            // In auto mode a forward to a node mate that would be packed is a message of its
            // own, sent as it arrived: no pack at all.
            if mode == Mode::Auto {
                assert!(
                    programs
                        .iter()
                        .any(|p| arena_forwards(p).iter().any(|&(_, sends)| sends > 0)),
                    "{config:?}: no forward is sent straight from an arena"
                );
            }
            let forwarding: Vec<&RankProgram> =
                programs.iter().filter(|p| from_arena(p) > 0).collect();
            assert!(
                !forwarding.is_empty(),
                "{config:?}: no forward reads an arena"
            );
            let planner = Planner::new(vec![spec.clone()], config.clone()).unwrap();
            for p in forwarding {
                arena_forwards_follow_late_unpacks(p, &config);
                let sequential = planner.rank_program_sequential(p.rank).unwrap();
                assert_eq!(from_arena(&sequential), 0);
                assert_eq!(sequential.sends, {
                    // Same messages, in the same order; staged ones read other offsets.
                    let mut sends = p.sends.clone();
                    for (m, s) in sends.iter_mut().zip(&sequential.sends) {
                        m.loc = s.loc;
                    }
                    sends
                });
                // Under staging limits, only forwards whose receive still moves read an arena.
                for eighths in 0..=8 {
                    let limited = under_staging_limit(&planner, p.rank, eighths).program;
                    arena_forwards_follow_late_unpacks(&limited, &config);
                    assert!(from_arena(&limited) <= from_arena(p));
                }
            }
        }
    }
}

/// One source rank (node 0) → four replicas, one per node (nodes 1-4): the sender is four
/// times busier than any receiver, so most of its data crosses the network once, to one node,
/// and that node forwards it to the others (forwarding between receiving nodes).
#[test]
fn a_busy_sender_has_its_data_forwarded_between_receiving_nodes() {
    let spec = TensorSpec {
        shape: vec![256, 64],
        dtype: DType::Bfloat16,
        src: layout(grid(&[1], 0), &[Placement::Replicate]),
        dst: layout(
            Mesh::new(vec![4], vec![4, 8, 12, 16]).expect("valid mesh"),
            &[Placement::Replicate],
        ),
    };
    let tensor_bytes = 256 * 64 * 2;
    let sent_by = |programs: &[RankProgram], rank: u32| -> u64 {
        programs
            .iter()
            .filter(|p| p.rank == rank)
            .flat_map(|p| p.sends.iter())
            .map(|m| m.bytes)
            .sum()
    };
    for mode in [Mode::Staged, Mode::Auto] {
        for rounds in [2, 3, 5] {
            let base = Config {
                mode,
                topology: Topology::RanksPerNode(4),
                split_min_bytes: 64,
                rounds,
                ..Default::default()
            };
            let forwarded = run_checked(std::slice::from_ref(&spec), &base);
            let direct = run_checked(
                std::slice::from_ref(&spec),
                &Config {
                    relay: false,
                    ..base.clone()
                },
            );
            assert_eq!(sent_by(&direct, 0), 4 * tensor_bytes, "{base:?}");
            let sender = sent_by(&forwarded, 0);
            assert!(
                sender < 2 * tensor_bytes,
                "{base:?}: the sender sent {sender}"
            );
            // Receivers forward across nodes from their destination views.
            let forwarders = forwarded
                .iter()
                .filter(|p| p.rank != 0)
                .filter(|p| {
                    p.sends.iter().any(|m| m.loc.buffer == Buffer::Dst)
                        || p.packs.iter().any(|c| c.src.buffer == Buffer::Dst)
                })
                .count();
            assert!(forwarders >= 2, "{base:?}: {forwarders} forwarders");
        }
    }
}

/// Forwarding between receiving nodes whose nodes hold several replicas: hub → its node
/// mates and one member of every other node, which relays to its own mates a round later.
#[test]
fn forwarded_data_reaches_node_mates_of_every_receiving_node() {
    let spec = TensorSpec {
        shape: vec![128, 96],
        dtype: DType::Bfloat16,
        src: layout(grid(&[2], 0), &[Placement::Shard(1)]),
        // 3 nodes × 2 replicas of a TP2 shard: ranks 4..16, 4 per node.
        dst: layout(
            grid(&[6, 2], 4),
            &[Placement::Replicate, Placement::Shard(0)],
        ),
    };
    for mode in [Mode::Staged, Mode::Auto] {
        for rounds in [2, 4] {
            run_checked(
                std::slice::from_ref(&spec),
                &Config {
                    mode,
                    topology: Topology::RanksPerNode(4),
                    split_min_bytes: 64,
                    rounds,
                    ..Default::default()
                },
            );
        }
    }
}

/// Sixteen bf16 tensors of `rows` × 64 replicated on one sender (rank 0) and on `receivers`
/// ranks, one per node, planned in `mode` over `rounds` rounds with 64-byte splits: every
/// receiving node holds one replica, so what the sender cannot send to all is forwarded.
fn one_sender_to_replicas_on_their_own_nodes(
    rows: u64,
    receivers: u64,
    rounds: u32,
    mode: Mode,
) -> (Vec<TensorSpec>, Config) {
    let spec = TensorSpec {
        shape: vec![rows, 64],
        dtype: DType::Bfloat16,
        src: layout(grid(&[1], 0), &[Placement::Replicate]),
        dst: layout(grid(&[receivers], 1), &[Placement::Replicate]),
    };
    let config = Config {
        mode,
        topology: Topology::RanksPerNode(1),
        split_min_bytes: 64,
        rounds,
        ..Default::default()
    };
    (vec![spec; 16], config)
}

/// Overlaps forwarded between nodes that each hold one receiver are cut into chunks of a pair
/// part / 8, at least `split_min_bytes` (here that), not eight times `split_min_bytes` as for
/// NVLink relays (where each chunk is one message per node mate), so each receiver takes every
/// tensor in pieces over nearly every round instead of in a few lumps: one sender, eight
/// replicas on eight nodes, twelve rounds, tensors of 4 KiB: twelve chunks, which reach each
/// receiver in at least nine rounds (some forwarded ones arrive in the same round as others);
/// before, eight chunks reached it in seven or eight. Byte-exact on the host executor.
#[test]
fn forwarded_overlaps_spread_over_every_round() {
    for mode in [Mode::Staged, Mode::Auto] {
        let (tensors, config) = one_sender_to_replicas_on_their_own_nodes(32, 8, 12, mode);
        run_checked(&tensors, &config);
        let planner = Planner::new(tensors.clone(), config).unwrap();
        let mut forwarded = 0;
        for rank in 1..=8 {
            let blocks = planner.rank_blocks(rank).unwrap();
            forwarded += blocks
                .iter()
                .filter(|b| b.to == rank && b.from != 0)
                .count();
            let mut rounds_of: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
            for t in planner.transfers(&blocks) {
                let block = &blocks[t.block];
                if block.to == rank {
                    rounds_of.entry(block.tensor).or_default().insert(t.round);
                }
            }
            assert_eq!(rounds_of.len(), 16, "{mode:?}: rank {rank}");
            for (tensor, taken) in &rounds_of {
                assert!(
                    taken.len() >= 9,
                    "{mode:?}: rank {rank} takes tensor {tensor} in rounds {taken:?}"
                );
            }
        }
        assert!(forwarded > 0, "{mode:?}: nothing is forwarded");
    }
}

/// An overlap relayed over NVLink is cut into one chunk per (node mate, round) when it is
/// large enough, so each mate takes a share of it in every round and its sender sends it in
/// every round: four senders on two nodes, four replicas on two other nodes (two per node),
/// four rounds, each sender's 4 KiB quarter of a tensor cut into 8 chunks of 512 bytes (8 ×
/// `split_min_bytes`). Before, the overlap was cut into as many chunks as rounds, which gave
/// each mate two chunks, in two rounds. Byte-exact on the host executor.
#[test]
fn relayed_overlaps_reach_every_node_mate_in_every_round() {
    for mode in [Mode::Staged, Mode::Auto] {
        let spec = TensorSpec {
            shape: vec![128, 64],
            dtype: DType::Bfloat16,
            src: layout(grid(&[4], 0), &[Placement::Shard(0)]),
            dst: layout(grid(&[4], 4), &[Placement::Replicate]),
        };
        let config = Config {
            mode,
            topology: Topology::RanksPerNode(2),
            split_min_bytes: 64,
            rounds: 4,
            ..Default::default()
        };
        let tensors = vec![spec; 8];
        run_checked(&tensors, &config);
        let planner = Planner::new(tensors.clone(), config).unwrap();
        for rank in 4..8 {
            let blocks = planner.rank_blocks(rank).unwrap();
            // Rounds in which the rank takes each (tensor, sender) overlap's bytes across the
            // network (its node mate's share comes over NVLink, in the round after).
            let mut rounds_of: BTreeMap<(u32, u32), BTreeSet<u32>> = BTreeMap::new();
            for t in planner.transfers(&blocks) {
                let block = &blocks[t.block];
                if block.to == rank && block.from < 4 {
                    rounds_of
                        .entry((block.tensor, block.from))
                        .or_default()
                        .insert(t.round);
                }
            }
            assert_eq!(rounds_of.len(), 8 * 4, "{mode:?}: rank {rank}");
            for ((tensor, from), taken) in &rounds_of {
                assert_eq!(
                    taken.len(),
                    4,
                    "{mode:?}: rank {rank} takes tensor {tensor} from {from} in rounds {taken:?}"
                );
            }
        }
    }
}

/// One sender feeding 48 replicas of 16 tensors, one per node, over 24 rounds: every chunk is
/// forwarded, and a hub forwarding each chunk to all 47 other nodes in the next round would
/// make every two receivers exchange a message in every round (2 × 47 × 23 = 2,162 per rank,
/// over half the auto-mode budget). The hub spreads its forwards over two rounds instead: two
/// receivers exchange messages only in rounds of one parity, and every byte still arrives.
#[test]
fn forwards_between_many_receiving_nodes_are_spread_over_rounds() {
    for mode in [Mode::Staged, Mode::Auto] {
        let (tensors, config) = one_sender_to_replicas_on_their_own_nodes(512, 48, 24, mode);
        let programs = run_checked(&tensors, &config);
        // Rounds in which each receiver sends to each other receiver.
        let mut rounds_of: BTreeMap<(u32, u32), BTreeSet<u32>> = BTreeMap::new();
        for p in programs.iter().filter(|p| p.rank != 0) {
            for round in p.rounds() {
                for m in round.sends {
                    rounds_of
                        .entry((p.rank, m.peer))
                        .or_default()
                        .insert(round.round);
                }
            }
        }
        assert!(
            rounds_of.len() > 1000,
            "{mode:?}: {} pairs",
            rounds_of.len()
        );
        for ((from, to), rounds) in &rounds_of {
            let parities: BTreeSet<u32> = rounds.iter().map(|r| r % 2).collect();
            assert_eq!(
                parities.len(),
                1,
                "{mode:?}: {from} → {to} in rounds {rounds:?}"
            );
        }
        assert!(
            rounds_of.values().any(|r| r.len() >= 3),
            "{mode:?}: pairs forward in several rounds"
        );
        let most = programs
            .iter()
            .map(|p| p.sends.len() + p.recvs.len())
            .max()
            .unwrap();
        assert!(most <= 1200, "{mode:?}: a rank posts {most} messages");
    }
}

/// Late unpacks under staging limits between what the program without them needs and what
/// they all need: each rank keeps within its limit by moving only some rounds' largest
/// receives into the arenas (docs/executor.md, "Overlapping unpacks"), the other unpacks run
/// before the next round, and every byte still lands (the host executor runs late unpacks as
/// late as an executor may).
#[test]
fn staging_limits_keep_some_unpacks_late_and_every_byte_right() {
    // Three column-sharded tensors of different widths into row shards replicated over two
    // nodes: node-mates receive relayed data into staging in every round, pieces of several
    // sizes, and nothing later reads what they unpack.
    let tensors: Vec<TensorSpec> = [96u64, 48, 160]
        .iter()
        .map(|&cols| TensorSpec {
            shape: vec![64, cols],
            ..tp2_to_tp2_dp4_on_two_nodes()
        })
        .collect();
    let config = Config {
        mode: Mode::Staged,
        topology: Topology::RanksPerNode(4),
        split_min_bytes: 64,
        rounds: 4,
        ..Default::default()
    };
    let planner = Planner::new(tensors.clone(), config).unwrap();
    let ranks = planner.ranks();
    let late = |p: &RankProgram| p.round_spans.iter().map(|s| s.late_unpacks).sum::<usize>();
    let mut partial = 0;
    for step in 0..=8u64 {
        let programs: Vec<RankProgram> = ranks
            .iter()
            .map(|&r| {
                let Limited {
                    program: p,
                    all,
                    none,
                    limit,
                } = under_staging_limit(&planner, r, step);
                assert!(late(&p) <= late(&all), "rank {r}");
                if step == 8 {
                    assert_eq!(p, all, "rank {r}: every late unpack fits");
                }
                if late(&p) == 0 {
                    assert_eq!(p, none, "rank {r}: nothing fits {limit}");
                }
                // The same messages (forwards may read the arena their data arrived in).
                let messages = |p: &RankProgram| -> Vec<(u32, u64)> {
                    p.sends
                        .iter()
                        .chain(&p.recvs)
                        .map(|m| (m.peer, m.bytes))
                        .collect()
                };
                assert_eq!(messages(&p), messages(&none));
                partial += usize::from(late(&p) > 0 && late(&p) < late(&all));
                p
            })
            .collect();
        let before = initial_buffers(&tensors, &ranks);
        let mut buffers = before.clone();
        execute(&programs, &mut buffers).unwrap_or_else(|e| panic!("step {step}: {e}"));
        verify(&tensors, &ranks, &before, &buffers);
    }
    assert!(partial > 0, "no rank kept only some of its unpacks late");
}

/// Auto mode in several rounds (docs/planner.md §4): a pair's piece that is one run in the
/// receiver's view and holds at least a pair part / 8 (and 1 MiB) lands there, a message of
/// its own, though the sender's side is strided (row shards of column-sharded sources: the
/// sender packs it); smaller pieces of the same pair and round travel in one staged message
/// that the receiver unpacks.
#[test]
fn pieces_contiguous_only_at_the_destination_land_there() {
    // Row shards over ranks 0–1 into column shards over ranks 2–5: every piece is 512 rows
    // of a quarter of the columns, strided in the sender's shard and one run in the
    // receiver's. Tensors 0 and 1: 2 MiB pieces; 2 and 3: 512 B pieces.
    let spec = |rows: u64, cols: u64| TensorSpec {
        shape: vec![rows, cols],
        dtype: DType::Float32,
        src: layout(grid(&[2], 0), &[Placement::Shard(0)]),
        dst: layout(grid(&[4], 2), &[Placement::Shard(1)]),
    };
    let tensors = vec![
        spec(1024, 4096),
        spec(1024, 4096),
        spec(16, 64),
        spec(16, 64),
    ];
    let config = Config {
        mode: Mode::Auto,
        rounds: 2,
        ..Default::default()
    };
    let programs = run_checked(&tensors, &config);
    let mib = 1u64 << 20;
    for p in &programs[2..] {
        let r = p.rank;
        // Both large pieces from each of the two senders land in place, whatever round.
        let in_place: Vec<&Message> = p.recvs.iter().filter(|m| m.bytes >= mib).collect();
        assert!(
            in_place.len() >= 4 && in_place.iter().all(|m| m.loc.buffer == Buffer::Dst),
            "rank {r}: {:?}",
            p.recvs
        );
        assert_eq!(
            in_place.iter().map(|m| m.bytes).sum::<u64>(),
            2 * 2 * 512 * 1024 * 4,
            "rank {r}"
        );
        // Only the small tensors are unpacked, from staged receives.
        assert!(!p.unpacks.is_empty(), "rank {r}");
        assert!(
            p.unpacks.iter().all(|u| u.dst.tensor >= 2),
            "rank {r}: {:?}",
            p.unpacks
        );
        assert!(p.recvs.iter().any(|m| m.loc.buffer == Buffer::Staging));
    }
    for p in &programs[..2] {
        // The senders pack the large pieces (their rows are strided) into staging.
        let packed: u64 = p
            .packs
            .iter()
            .filter(|c| c.src.tensor < 2)
            .map(|c| c.bytes())
            .sum();
        assert_eq!(packed, 2 * 4 * 512 * 1024 * 4, "rank {}", p.rank);
    }
}

// Receiving in place (`plan::in_place`): destination views at offsets back to back.

/// Every rank's program from `exec::Plan` (the path `ncclReshardPlanCreate` takes), its
/// destination views at offsets back to back in tensor order but for a `gap` of bytes before
/// tensor `t` where `gaps[t % gaps.len()]`; `None` if some rank's plan is refused.
fn placed_programs(
    tensors: &[TensorSpec],
    config: &Config,
    gaps: &[bool],
    gap: u64,
) -> Option<Vec<RankProgram>> {
    all_ranks(tensors)
        .iter()
        .map(|&r| {
            let mut at = 0u64;
            let placed = tensors
                .iter()
                .enumerate()
                .map(|(t, spec)| {
                    let extent = OracleView::of(spec, &spec.dst, r).map_or(0, |v| v.extent());
                    let offset = at + if gaps[t % gaps.len()] { gap } else { 0 };
                    at = offset + extent as u64;
                    PlanTensor {
                        dst_offset: offset,
                        ..PlanTensor::new(spec.clone())
                    }
                })
                .collect();
            // The single-buffer call's program.
            Plan::new(placed, r, config.clone(), StagingLimit::new(0), &NoLimits)
                .ok()
                .map(|plan| (**plan.placed().unwrap_or(plan.program())).clone())
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Destination views back to back in tensor order (now and then a gap before one):
    /// receives whose bytes would be unpacked, in order, onto adjacent views land there, and
    /// every byte still lands, no byte beside a view changes.
    #[test]
    fn receives_landing_in_place_are_byte_exact(
        tensors in tensors(),
        config in config(prop::sample::select(vec![Mode::Staged, Mode::Auto])),
        gaps in prop::collection::vec(prop::bool::weighted(0.2), 1..=5),
    ) {
        let Some(programs) = placed_programs(&tensors, &config, &gaps, 64) else {
            return Ok(());
        };
        let ranks = all_ranks(&tensors);
        let before = initial_buffers(&tensors, &ranks);
        let mut buffers = before.clone();
        execute(&programs, &mut buffers).unwrap_or_else(|e| panic!("execute: {e}"));
        verify(&tensors, &ranks, &before, &buffers);
        verify_accounting(&tensors, &ranks, &programs);
    }
}

#[test]
fn receives_land_in_place_where_views_sit_back_to_back() {
    // 8 tensors [16, 24] f32, 0..4 whole on rank 0 and 4..8 on rank 1, split by columns over
    // ranks 2 and 3: a sender packs its column halves (strided in its view), and each
    // receives 4 whole views of consecutive tensors in one staged message per sender.
    let tensors: Vec<TensorSpec> = (0..8u32)
        .map(|k| TensorSpec {
            shape: vec![16, 24],
            dtype: DType::Float32,
            src: layout(
                Mesh::new(vec![1], vec![k / 4]).unwrap(),
                &[Placement::Replicate],
            ),
            dst: layout(grid(&[2], 2), &[Placement::Shard(1)]),
        })
        .collect();
    let ranks = all_ranks(&tensors);
    for (gap, in_place) in [(0u64, true), (64, false)] {
        for mode in [Mode::Staged, Mode::Auto] {
            let programs =
                placed_programs(&tensors, &with_mode(mode), &[true], gap).expect("plans");
            for p in programs.iter().filter(|p| p.rank >= 2) {
                assert_eq!(p.recvs.len(), 2, "rank {}: one message per sender", p.rank);
                let landed = p.recvs.iter().all(|m| m.loc.buffer == Buffer::Dst);
                assert_eq!(
                    landed, in_place,
                    "rank {} with gaps of {gap}: {:?}",
                    p.rank, p.recvs
                );
                if in_place {
                    assert!(
                        p.unpacks.is_empty() && p.staging_bytes == 0,
                        "rank {}",
                        p.rank
                    );
                    let runs: Vec<(u32, u32)> =
                        p.dst_after.iter().map(|a| (a.view, a.next)).collect();
                    assert_eq!(runs, [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)]);
                    assert!(p.dst_after.iter().all(|a| a.bytes == 16 * 12 * 4));
                } else {
                    assert_eq!(p.unpacks.len(), 8);
                    assert!(p.dst_after.is_empty());
                }
            }
            let before = initial_buffers(&tensors, &ranks);
            let mut buffers = before.clone();
            execute(&programs, &mut buffers).unwrap_or_else(|e| panic!("execute: {e}"));
            verify(&tensors, &ranks, &before, &buffers);
        }
    }
}

/// Sixteen training ranks (`Shard(0)`) on node 0 and sixteen inference ranks (`dp2 × tp8`) on
/// node 1, sixteen ranks per node, 4 rounds.
fn sixteen_senders_on_a_node(sender_barrier: Option<bool>, per_node: u32) -> (TensorSpec, Config) {
    let spec = TensorSpec {
        shape: vec![256, 64],
        dtype: DType::Bfloat16,
        src: layout(grid(&[16], 0), &[Placement::Shard(0)]),
        dst: layout(
            grid(&[2, 8], 16),
            &[Placement::Replicate, Placement::Shard(1)],
        ),
    };
    let config = Config {
        mode: Mode::Auto,
        topology: Topology::RanksPerNode(per_node),
        split_min_bytes: 64,
        rounds: 4,
        sender_barrier,
        ..Default::default()
    };
    (spec, config)
}

#[test]
fn sending_only_ranks_of_a_node_pass_a_barrier_before_each_round() {
    // (setting, ranks per node) → the members of rank 5's barrier.
    let cases: [(Option<bool>, u32, Vec<u32>); 5] = [
        // Unset: a node of 16 sending-only ranks (more than one NVLink server's 8) has one.
        (None, 16, (0..16).collect()),
        // Unset on nodes of 4: none; switched on: the node's 4.
        (None, 4, Vec::new()),
        (Some(true), 4, (4..8).collect()),
        (Some(false), 16, Vec::new()),
        // Switched on with one rank per node: nobody to wait for.
        (Some(true), 1, Vec::new()),
    ];
    for (setting, per_node, members) in cases {
        let (spec, config) = sixteen_senders_on_a_node(setting, per_node);
        let programs = run_checked(std::slice::from_ref(&spec), &config);
        let planner = Planner::new(vec![spec.clone()], config.clone()).expect("valid plan");
        assert_eq!(planner.barrier_members(5), members, "{config:?}");
        for p in &programs {
            let mine = planner.barrier_members(p.rank);
            if p.rank >= 16 || mine.is_empty() {
                // Receivers never pass it.
                assert!(mine.is_empty() && !p.has_barrier(), "rank {}", p.rank);
                continue;
            }
            assert!(
                p.has_barrier() && p.mode() == ExecMode::Staged,
                "rank {}",
                p.rank
            );
            assert_eq!(p.barrier_rounds, planner.rounds());
            assert_eq!(p.barrier_members, mine);
            // A dissemination barrier: in step s, to the member 2^s after, from the one 2^s
            // before (cyclically); ⌈log2 n⌉ steps.
            let n = mine.len();
            let me = mine.iter().position(|&m| m == p.rank).unwrap();
            let steps = (usize::BITS - (n - 1).leading_zeros()) as usize;
            let peers = |list: &[Message]| list.iter().map(|m| m.peer).collect::<Vec<_>>();
            let to: Vec<u32> = (0..steps).map(|s| mine[(me + (1 << s)) % n]).collect();
            let from: Vec<u32> = (0..steps).map(|s| mine[(me + n - (1 << s)) % n]).collect();
            assert_eq!(peers(&p.barrier_sends), to);
            assert_eq!(peers(&p.barrier_recvs), from);
            // Its slots sit after every byte of staging the rounds use: its own and one per
            // step.
            let used = p.packs.iter().map(|c| c.dst.offset + c.bytes()).max();
            let slots: BTreeSet<u64> = p
                .barrier_sends
                .iter()
                .take(1)
                .chain(&p.barrier_recvs)
                .map(|m| m.loc.offset)
                .collect();
            assert_eq!(slots.len(), steps + 1);
            assert!(slots.iter().all(|&s| used.map_or(true, |u| s >= u)));
            assert!(slots.iter().all(|&s| s + 8 <= p.staging_bytes));
        }
    }
    // One round: nothing to keep in step.
    let (spec, mut config) = sixteen_senders_on_a_node(Some(true), 16);
    config.rounds = 1;
    let programs = run_checked(std::slice::from_ref(&spec), &config);
    assert!(programs.iter().all(|p| !p.has_barrier()));
}

#[test]
fn a_rank_that_skips_the_senders_barrier_makes_its_mates_fail_not_hang() {
    let (spec, config) = sixteen_senders_on_a_node(None, 16);
    let planner = Planner::new(vec![spec.clone()], config).expect("valid plan");
    let ranks = planner.ranks();
    let mut programs: Vec<RankProgram> = ranks
        .iter()
        .map(|&r| planner.rank_program(r).expect("program"))
        .collect();
    assert!(programs[0].has_barrier());
    programs[0].barrier_rounds = 0;
    programs[0].barrier_sends.clear();
    programs[0].barrier_recvs.clear();
    let buffers = initial_buffers(std::slice::from_ref(&spec), &ranks);
    match execute_with_deadline(programs, buffers) {
        None => panic!("execute hung on a rank that skips the barrier"),
        Some(Ok(())) => panic!("a rank that skips the barrier went unnoticed"),
        // Rank 1 hears from rank 0 in the barrier's first step.
        Some(Err(e)) => assert!(
            e.message.contains("rank 1 expects")
                && e.message.contains("from rank 0")
                && e.message
                    .contains("step 0 of the senders' barrier before round 1"),
            "{}",
            e.message
        ),
    }
}

#[test]
fn a_sending_only_rank_with_nothing_to_send_still_passes_the_barrier() {
    // Rank 3's only shard is empty (3 rows over 4 ranks).
    let to_inference = || {
        layout(
            grid(&[2, 2], 4),
            &[Placement::Replicate, Placement::Shard(0)],
        )
    };
    let tensors = vec![
        TensorSpec {
            shape: vec![64, 48],
            dtype: DType::Bfloat16,
            src: layout(grid(&[3], 0), &[Placement::Shard(1)]),
            dst: to_inference(),
        },
        TensorSpec {
            shape: vec![3, 16],
            dtype: DType::Float32,
            src: layout(grid(&[4], 0), &[Placement::Shard(0)]),
            dst: to_inference(),
        },
    ];
    let config = Config {
        mode: Mode::Auto,
        topology: Topology::RanksPerNode(4),
        split_min_bytes: 64,
        rounds: 3,
        sender_barrier: Some(true),
        ..Default::default()
    };
    let programs = run_checked(&tensors, &config);
    let idle = &programs[3];
    assert!(idle.sends.is_empty() && idle.has_barrier() && !idle.is_empty());
    assert_eq!(idle.peers(), [0, 1, 2]);
}
