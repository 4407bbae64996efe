//! Casting and quantizing on the way, end to end on the host executor: every destination
//! element and every scale equals what the reference quantizer
//! (`ncclreshard_tools::reference_quantizer`, from the published definitions) makes of the whole
//! tensor, over random layouts, block sizes, shard boundaries, strided views and modes; blocks
//! travel converted when a source shard holds them whole; plan creation refuses exactly the
//! layouts where neither side holds some block whole, by the oracle's owner tables.

mod oracle;

use ncclreshard::plan::Buffer;
use ncclreshard::quant::{Conversion, ScaleFormat, Scheme};
use ncclreshard::{Config, DType, Layout, Mesh, Mode, Placement, Planner, TensorSpec, Topology};
use ncclreshard_tools::check::{check_with_conversions, CheckReport};
use oracle::strategies::{layout_on, mesh, tensor_on, without_blocks};
use proptest::prelude::*;

fn layout(shape: &[u64], ranks: &[u32], placements: &[Placement]) -> Layout {
    Layout::new(
        Mesh::new(shape.to_vec(), ranks.to_vec()).unwrap(),
        placements.to_vec(),
    )
}

fn block(rows: u64, cols: u64) -> Conversion {
    Conversion::quantize(DType::Float8E4M3, Scheme::Block { rows, cols })
}

fn auto() -> Config {
    Config {
        mode: Mode::Auto,
        ..Default::default()
    }
}

/// `spec` converted by `conversion` under `config`, checked byte-exact on the host executor
/// (the report), and its planner, for looking at the ranks' programs.
fn checked(spec: TensorSpec, conversion: Conversion, config: Config) -> (CheckReport, Planner) {
    let report = check_with_conversions(
        std::slice::from_ref(&spec),
        &[Some(conversion.clone())],
        &config,
    )
    .unwrap();
    let planner = Planner::with_conversions(vec![spec], vec![Some(conversion)], config).unwrap();
    (report, planner)
}

/// [512, 384] bf16 from trainer TP2 on rows (ranks 0, 1) to inference TP3 on columns (ranks
/// 2-4).
fn tp2_rows_to_tp3_columns() -> TensorSpec {
    TensorSpec {
        shape: vec![512, 384],
        dtype: DType::Bfloat16,
        src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
        dst: layout(&[3], &[2, 3, 4], &[Placement::Shard(1)]),
    }
}

#[test]
fn a_bf16_weight_arrives_as_fp8_blocks_with_its_scales() {
    // [512, 384] bf16: trainer TP2 on rows (whole 128-row blocks per shard) → inference TP3 on
    // columns, on other ranks: every block is converted by its sender and travels as FP8.
    let (report, planner) = checked(tp2_rows_to_tp3_columns(), block(128, 128), auto());
    assert_eq!(report.elements_checked, 512 * 384 + 3 * 4);
    // One byte per element on the wire, plus 4 per scale (each receiver gets the scales of
    // its column of blocks from both senders).
    assert_eq!(report.bytes_sent, 512 * 384 + 3 * 4 * 4);
    let sender = planner.rank_program(0).unwrap();
    assert_eq!(sender.converts_before.len(), 1);
    assert!(sender.converts_after.is_empty());
    assert_eq!(sender.work_bytes, 256 * 384 + 2 * 3 * 4);
}

/// One sender holding sixteen bf16 tensors whole, eight replicas of each on eight nodes (one
/// per node), FP8 128×128 blocks: the sender is eight times busier than any receiver, so its
/// data is cut into chunks that cross the network once, to one node, and are forwarded from
/// there. A forwarded chunk's round follows where it sits among the sender's bytes, as a
/// pair's stream takes them (`assign.rs`, `Prepared::stream_round`), and the scales move in the
/// last round, so the sender's first round reads (and must convert first) a round's share of
/// its tensors: a fifth (5 rounds of data after the round that primes the forwarding; a
/// quarter before 0.19, whose plan had no priming round and 4 rounds for hub chunks). With
/// hashed rounds it was all of them (a piece of every tensor went in a first round); with
/// hashed rounds and scales in the last round, 72 %; with stream rounds
/// and scales in the pairs' streams (which held nothing else, one chunk each, some in round 0),
/// all of them. Byte-exact on the host executor.
#[test]
fn a_sender_converts_what_it_forwards_in_about_the_round_it_sends_it() {
    let spec = TensorSpec {
        shape: vec![256, 256],
        dtype: DType::Bfloat16,
        src: layout(&[1], &[0], &[Placement::Replicate]),
        dst: layout(&[8], &[1, 2, 3, 4, 5, 6, 7, 8], &[Placement::Replicate]),
    };
    let tensors = vec![spec; 16];
    let conversions = vec![Some(block(128, 128)); 16];
    for mode in [Mode::Staged, Mode::Auto] {
        let config = Config {
            mode,
            topology: Topology::RanksPerNode(1),
            split_min_bytes: 4096,
            rounds: 5,
            ..Default::default()
        };
        check_with_conversions(&tensors, &conversions, &config).unwrap();
        let planner =
            Planner::with_conversions(tensors.clone(), conversions.clone(), config).unwrap();
        let program = planner.rank_program(0).unwrap();
        assert!(
            program.recvs.is_empty() && !program.sends.is_empty(),
            "{mode:?}"
        );
        let per_round: Vec<u64> = program
            .rounds()
            .iter()
            .map(|r| r.converts.iter().map(|c| c.elements()).sum())
            .collect();
        let all: u64 = per_round.iter().sum();
        assert_eq!(all, 16 * 256 * 256, "{mode:?}: {per_round:?}");
        // The plan primes its forwarding (docs/planner.md, "The priming round": 5 rounds of
        // data after round 0): forwarded chunks take the first 5 of the 6 rounds (the last is
        // the forwards'), a fifth of the tensors each, within half a tensor's chunks.
        assert_eq!(per_round.len(), 6, "{mode:?}: {per_round:?}");
        assert_eq!(per_round[5], 0, "{mode:?}: {per_round:?}");
        for &round in &per_round[..5] {
            assert!(
                round.abs_diff(all / 5) <= 256 * 256 / 2,
                "{mode:?}: conversions by round {per_round:?}"
            );
        }
    }
}

/// Stacked experts [4, 256, 256] held whole by one sender, two receivers each holding half of
/// every expert's rows (TP2 on dim 1), each pair's data in one round, the two pairs in different
/// rounds: each round reads a thin slice of every expert. The sender converts each slice
/// before the round that sends it, half of the tensor per round: slabs are cut along every dim
/// of more than one block and matched to the strided reads exactly (`by_first_read`). Until
/// 0.14 slabs were whole experts keyed by the extents of reads, and the first round's read,
/// which spans every expert, made the sender convert the whole tensor before it.
#[test]
fn a_round_reading_a_slice_of_every_expert_converts_only_that_slice_first() {
    let spec = TensorSpec {
        shape: vec![4, 256, 256],
        dtype: DType::Bfloat16,
        src: layout(&[1], &[0], &[Placement::Replicate]),
        dst: layout(&[2], &[1, 2], &[Placement::Shard(1)]),
    };
    let conversion = block(128, 128);
    let config = Config {
        mode: Mode::Staged,
        rounds: 2,
        split_min_bytes: 1 << 20,
        ..Default::default()
    };
    let (_, planner) = checked(spec, conversion, config);
    let program = planner.rank_program(0).unwrap();
    let rounds = program.rounds();
    let peers: Vec<Vec<u32>> = rounds
        .iter()
        .map(|r| r.sends.iter().map(|m| m.peer).collect())
        .collect();
    // The first round sends one receiver its data, the last the other its data and both
    // their scales.
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert!(
        peers[0].len() == 1 && peers[1].len() == 2,
        "one receiver's data per round: {peers:?}"
    );
    let per_round: Vec<u64> = rounds
        .iter()
        .map(|r| r.converts.iter().map(|c| c.elements()).sum())
        .collect();
    assert_eq!(per_round, [4 * 128 * 256, 4 * 128 * 256]);
}

#[test]
fn a_senders_conversions_follow_its_rounds() {
    // [1024, 512] bf16, trainer TP2 on rows → inference TP4 on columns, in 4 rounds with small
    // chunks: each pair's stream goes out in round order, so a sender's later rounds read
    // blocks its first round does not, and their conversions run beside the round before (the
    // host executor runs them as late as allowed: just before their round's packs).
    let spec = TensorSpec {
        shape: vec![1024, 512],
        dtype: DType::Bfloat16,
        src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
        dst: layout(&[4], &[2, 3, 4, 5], &[Placement::Shard(1)]),
    };
    let conversion = block(128, 128);
    let config = Config {
        rounds: 4,
        split_min_bytes: 4096,
        ..auto()
    };
    let (report, planner) = checked(spec, conversion, config);
    assert_eq!(report.elements_checked, 1024 * 512 + 4 * 8);
    for sender in 0..2 {
        let program = planner.rank_program(sender).unwrap();
        let rounds = program.rounds();
        let per_round: Vec<u64> = rounds
            .iter()
            .map(|r| r.converts.iter().map(|c| c.elements()).sum())
            .collect();
        assert_eq!(
            per_round.iter().sum::<u64>(),
            512 * 512,
            "rank {sender}: {per_round:?}"
        );
        // Each pair's stream holds the blocks' values alone (scales move in the last round),
        // 128 rows of 128 FP8 columns per round: each round converts one row of blocks. (When
        // the scales closed the stream, they shifted the chunk boundaries into the next block
        // row: the first round converted two rows, the last none.)
        assert_eq!(
            per_round,
            [1, 1, 1, 1].map(|rows| rows * 128 * 512),
            "rank {sender}"
        );
        assert!(program.has_side_work());
        // No byte a round's conversions write is read (packed or sent) by an earlier round.
        let mut read_by = vec![usize::MAX; program.work_bytes as usize];
        for (k, round) in rounds.iter().enumerate() {
            let packed = round.packs.iter().flat_map(|c| {
                let (src, chunk) = (c.src, c.chunk_bytes);
                grid(c.dims.iter().map(|d| (d.count, d.src_stride)))
                    .flat_map(move |at| (0..chunk).map(move |b| (src, at + b)))
            });
            let sent = round
                .sends
                .iter()
                .flat_map(|m| (0..m.bytes).map(move |b| (m.loc, b)));
            for (loc, at) in packed.chain(sent) {
                if loc.buffer == Buffer::Work {
                    let byte = &mut read_by[(loc.offset + at) as usize];
                    *byte = (*byte).min(k);
                }
            }
        }
        for (k, round) in rounds.iter().enumerate() {
            for c in round.converts {
                let written = grid(c.dims.iter().map(|d| (d.count, d.dst_stride)));
                for at in written {
                    let first = read_by[(c.dst.offset + at) as usize];
                    assert!(first >= k, "rank {sender}: round {k} converts byte {at} of {:?}, read in round {first}", c.start);
                }
            }
        }
    }
}

#[test]
fn a_per_channel_quantization_of_many_rows_is_cut_into_a_bounded_number_of_slabs() {
    // Per-channel blocks are single rows: 2^20 rows per sender, sent over 4 rounds, must not
    // become 2^20 conversions (the fuzzer's plan_create found planning taking seconds).
    let spec = TensorSpec {
        shape: vec![1 << 21, 2],
        dtype: DType::Float32,
        src: layout(&[2], &[0, 1], &[Placement::Shard(0)]),
        dst: layout(&[2], &[2, 3], &[Placement::Shard(1)]),
    };
    let config = Config {
        rounds: 4,
        split_min_bytes: 4096,
        ..auto()
    };
    let started = std::time::Instant::now();
    let planner = Planner::with_conversions(
        vec![spec],
        vec![Some(Conversion::quantize(
            DType::Float8E4M3,
            Scheme::PerChannel,
        ))],
        config,
    )
    .unwrap();
    for sender in 0..2 {
        let program = planner.rank_program(sender).unwrap();
        let elements: u64 = program.converts_before.iter().map(|c| c.elements()).sum();
        assert_eq!(elements, 1 << 21);
        assert!(
            program.converts_before.len() <= 64,
            "{}",
            program.converts_before.len()
        );
    }
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}

/// Byte offsets of every point of a grid of (count, stride) dims, outermost first.
fn grid(dims: impl Iterator<Item = (u64, u64)>) -> impl Iterator<Item = u64> {
    dims.fold(
        Box::new(std::iter::once(0u64)) as Box<dyn Iterator<Item = u64>>,
        |points, (count, stride)| {
            Box::new(points.flat_map(move |p| (0..count).map(move |i| p + i * stride)))
        },
    )
}

/// What the oracle says about a converted tensor's blocks: some block is held whole by no
/// source rank and not whole by every destination rank holding part of it (`split`), or some
/// block converted by its receivers has its scale on ranks other than exactly those holding it
/// (`scale_holders`).
#[derive(Debug, Default)]
struct Feasibility {
    split: bool,
    scale_holders: bool,
    /// Some block is held whole by no source rank: its receivers convert it.
    receivers_convert: bool,
}

fn feasibility(spec: &TensorSpec, conversion: &Conversion) -> Feasibility {
    let mut out = Feasibility::default();
    let shape = &spec.shape;
    if shape.contains(&0) {
        return out;
    }
    let block = ncclreshard_tools::reference_quantizer::block_extent(conversion.scheme, shape);
    let grid: Vec<u64> = shape
        .iter()
        .zip(&block)
        .map(|(n, b)| n.div_ceil(*b))
        .collect();
    let lists = |layout: &Layout, shape: &[u64]| -> Vec<(u32, Vec<Vec<u64>>)> {
        oracle::mesh_ranks(layout)
            .into_iter()
            .map(|r| (r, oracle::local_index_lists(shape, layout, r).unwrap()))
            .collect()
    };
    let sources = lists(&spec.src, shape);
    let destinations = lists(&spec.dst, shape);
    let scale_layout = conversion.scale_layout(spec);
    let scale_holders = scale_layout.as_ref().map(|l| lists(l, &grid));
    for b in 0..oracle::element_count(&grid) {
        let b = oracle::multi_index(&grid, b);
        let range: Vec<std::ops::Range<u64>> = (0..shape.len())
            .map(|d| b[d] * block[d]..((b[d] + 1) * block[d]).min(shape[d]))
            .collect();
        let holds_whole = |l: &Vec<Vec<u64>>| {
            range
                .iter()
                .zip(l)
                .all(|(r, list)| r.clone().all(|i| list.contains(&i)))
        };
        let touches = |l: &Vec<Vec<u64>>| {
            range
                .iter()
                .zip(l)
                .all(|(r, list)| r.clone().any(|i| list.contains(&i)))
        };
        if sources.iter().any(|(_, l)| holds_whole(l)) {
            continue;
        }
        out.receivers_convert = true;
        let holders: Vec<u32> = destinations
            .iter()
            .filter(|(_, l)| touches(l))
            .map(|(r, _)| *r)
            .collect();
        if destinations
            .iter()
            .any(|(_, l)| touches(l) && !holds_whole(l))
        {
            out.split = true;
            continue;
        }
        if let Some(scales) = &scale_holders {
            let mut with_scale: Vec<u32> = scales
                .iter()
                .filter(|(_, l)| b.iter().zip(l).all(|(i, list)| list.contains(i)))
                .map(|(r, _)| *r)
                .collect();
            let mut holders = holders;
            holders.sort_unstable();
            with_scale.sort_unstable();
            if holders != with_scale {
                out.scale_holders = true;
            }
        }
    }
    out
}

fn conversion(src: DType) -> impl Strategy<Value = Conversion> {
    (
        prop_oneof![
            Just(DType::Bfloat16),
            Just(DType::Float16),
            Just(DType::Float8E4M3),
            Just(DType::Float8E5M2),
        ],
        prop_oneof![
            1 => Just(Scheme::None),
            1 => Just(Scheme::PerTensor),
            1 => Just(Scheme::PerChannel),
            4 => (1u64..=5, 1u64..=5).prop_map(|(rows, cols)| Scheme::Block { rows, cols }),
        ],
        prop_oneof![Just(ScaleFormat::Float32), Just(ScaleFormat::E8m0)],
        any::<bool>(),
    )
        .prop_map(move |(dtype, scheme, format, inverse)| {
            let fp8 = matches!(dtype, DType::Float8E4M3 | DType::Float8E5M2);
            let dtype = if dtype == src && !fp8 {
                DType::Float8E4M3
            } else {
                dtype
            };
            let fp8 = matches!(dtype, DType::Float8E4M3 | DType::Float8E5M2);
            Conversion {
                dtype,
                scheme: if fp8 { scheme } else { Scheme::None },
                scale_format: format,
                scale_inverse: inverse,
                scale_layout: None,
            }
        })
}

/// A converted tensor of 1..=3 dims on two random meshes over ranks 0..10 (so some ranks
/// are on both sides), possibly strided views, a scale layout now and then of its own, and a
/// config (mode, topology, rounds, small split sizes).
fn case() -> impl Strategy<Value = (TensorSpec, Conversion, Config)> {
    let shape = prop::collection::vec(1u64..=12, 1..=3);
    (
        shape,
        prop_oneof![
            Just(DType::Float32),
            Just(DType::Bfloat16),
            Just(DType::Float16)
        ],
        mesh(2, 3, 6, 4),
        mesh(2, 3, 6, 4),
    )
        .prop_flat_map(|(shape, dtype, src_mesh, dst_mesh)| {
            let n = shape.len();
            (
                tensor_on(
                    shape,
                    dtype,
                    layout_on(src_mesh, n),
                    layout_on(dst_mesh.clone(), n),
                ),
                conversion(dtype),
                prop::option::weighted(0.2, layout_on(dst_mesh, n).prop_map(without_blocks)),
                prop_oneof![Just(Mode::Auto), Just(Mode::Staged)],
                prop_oneof![Just(Topology::Unknown), Just(Topology::RanksPerNode(2))],
                0u32..=3,
                prop_oneof![Just(1u64), Just(64), Just(1 << 20)],
            )
        })
        .prop_map(
            |(spec, mut conversion, scale_layout, mode, topology, rounds, split)| {
                if conversion.is_scaled() {
                    conversion.scale_layout = scale_layout;
                }
                let config = Config {
                    mode,
                    topology,
                    rounds,
                    split_min_bytes: split,
                    ..Default::default()
                };
                (spec, conversion, config)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn every_converted_element_and_scale_equals_the_reference(
        (spec, conversion, config) in case(),
    ) {
        let oracle = feasibility(&spec, &conversion);
        let planned = Planner::with_conversions(
            vec![spec.clone()],
            vec![Some(conversion.clone())],
            config.clone(),
        );
        match planned {
            Err(e) => {
                let split = e.message.contains("neither side holds it whole");
                let holders = e.message.contains("write its scale themselves");
                prop_assert!(
                    (split && oracle.split) || (holders && oracle.scale_holders && !oracle.split),
                    "refused without cause: {} ({:?})", e, oracle
                );
            }
            Ok(planner) => {
                prop_assert!(!oracle.split && !oracle.scale_holders, "accepted {:?}", oracle);
                // Blocks travel converted exactly when a source shard holds them whole.
                let receiving = planner
                    .ranks()
                    .iter()
                    .any(|&r| !planner.rank_program(r).unwrap().converts_after.is_empty());
                prop_assert_eq!(receiving, oracle.receivers_convert);
                let report = check_with_conversions(
                    std::slice::from_ref(&spec),
                    &[Some(conversion.clone())],
                    &config,
                );
                prop_assert!(report.is_ok(), "{}", report.unwrap_err());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Several tensors in one plan, converted or not (their messages share pairs, staging and
    /// rounds; scale views follow the tensors'), the infeasible ones left out.
    #[test]
    fn converted_and_plain_tensors_share_a_plan(
        cases in prop::collection::vec((case(), any::<bool>()), 1..=4),
    ) {
        let config = cases[0].0 .2.clone();
        let mut specs = Vec::new();
        let mut conversions = Vec::new();
        for ((spec, conversion, _), plain) in cases {
            let f = feasibility(&spec, &conversion);
            if f.split || f.scale_holders {
                continue;
            }
            specs.push(spec);
            conversions.push((!plain).then_some(conversion));
        }
        prop_assume!(!specs.is_empty());
        let report = check_with_conversions(&specs, &conversions, &config);
        prop_assert!(report.is_ok(), "{}", report.unwrap_err());
    }
}

/// The senders' barrier with conversions: the two trainers of node 0 convert and send FP8
/// blocks over three rounds, passing the barrier before rounds 1 and 2; the receivers, which
/// also hold the scales, never pass it. Byte-exact on the host executor.
#[test]
fn converting_senders_pass_the_barrier_and_scale_holders_do_not() {
    let spec = tp2_rows_to_tp3_columns();
    let config = Config {
        mode: Mode::Auto,
        topology: Topology::RanksPerNode(2),
        split_min_bytes: 4096,
        rounds: 3,
        sender_barrier: Some(true),
        ..Default::default()
    };
    let conversion = block(128, 128);
    let (_, planner) = checked(spec, conversion, config);
    for rank in 0..5 {
        let program = planner.rank_program(rank).unwrap();
        let members: &[u32] = if rank < 2 { &[0, 1] } else { &[] };
        assert_eq!(planner.barrier_members(rank), members, "rank {rank}");
        assert_eq!(program.has_barrier(), rank < 2, "rank {rank}");
    }
}
