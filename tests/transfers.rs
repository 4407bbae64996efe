//! `ncclReshardPlanGetTransfers` is the plan as data (its header contract): running every
//! rank's transfer list with plain byte copies, under the execution rule the header states,
//! must leave exactly the destination views `ncclReshard` leaves.
//!
//! Plans are created and read back through the C ABI, the way a third-party transport gets
//! them. Each case checks that a pair's sends and receives agree field by field, that every
//! rank's transfers carry the bytes of its `RankProgram` per peer and round, that each
//! transfer's box and byte range name the data its copy moves (against the element values
//! `ncclreshard_tools::check` fills views with, from the global index alone), and that executing
//! the lists in round order — and in random orders the rule allows — reproduces every
//! destination view and no byte around it. Running them against the rule (later rounds first)
//! must break relayed plans: the rounds are load-bearing.

mod oracle;

use ncclreshard::exec::{Plan, PlanTensor, StagingLimit};
use ncclreshard::ffi::*;
use ncclreshard::layout::row_major_strides;
use ncclreshard::quant::Conversion;
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{
    Config, DType, Layout, Mesh, Mode, Placement, Planner, RankProgram, TensorSpec, Topology,
};
use ncclreshard_tools::check::{
    destination_view_bytes, element_value, source_view_bytes, verify_destination_view,
};
use oracle::strategies::{layout_on, mesh, tensor_on};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::os::raw::c_int;

const SEND: c_int = ncclReshardTransferKind_t::ncclReshardTransferSend as c_int;
const RECV: c_int = ncclReshardTransferKind_t::ncclReshardTransferRecv as c_int;
const LOCAL: c_int = ncclReshardTransferKind_t::ncclReshardTransferLocal as c_int;
const FROM_DESTINATION: c_int = ncclReshardView_t::ncclReshardViewDestination as c_int;
/// The struct's size before `round` (0.1): what an older caller passes.
const OLD_SIZE: usize = std::mem::offset_of!(ncclReshardTransfer_t, round);

/// The C descriptors of a plan, owning every array they point to (moving this struct moves no
/// array, so the pointers stay valid).
struct Descriptors {
    _ranks: Vec<Vec<c_int>>,
    _strides: Vec<Vec<i64>>,
    _layouts: Vec<ncclReshardLayout_t>,
    _nodes: Vec<c_int>,
    tensors: Vec<ncclReshardTensor_t>,
    config: ncclReshardConfig_t,
}

impl Descriptors {
    fn new(specs: &[TensorSpec], config: &Config) -> Descriptors {
        assert!(
            !config.local_via_messages,
            "not expressible in the C config"
        );
        let sides = || specs.iter().flat_map(|s| [&s.src, &s.dst]);
        let ranks: Vec<Vec<c_int>> = sides()
            .map(|l| l.mesh.ranks().iter().map(|&r| r as c_int).collect())
            .collect();
        let strides: Vec<Vec<i64>> = sides()
            .map(|l| {
                l.strides
                    .iter()
                    .flatten()
                    .map(|&s| s as i64)
                    .collect::<Vec<i64>>()
            })
            .collect();
        let layouts: Vec<ncclReshardLayout_t> = sides()
            .enumerate()
            .map(|(i, l)| c_layout(l, &ranks[i], l.strides.as_ref().map(|_| &strides[i])))
            .collect();
        let tensors = specs
            .iter()
            .enumerate()
            .map(|(t, spec)| {
                let mut c = ncclReshardTensor_t {
                    size: std::mem::size_of::<ncclReshardTensor_t>(),
                    version: NCCL_RESHARD_VERSION_CODE as u32,
                    ndim: spec.shape.len() as c_int,
                    shape: [0; NCCL_RESHARD_MAX_DIMS],
                    dtype: spec.dtype.nccl_code(),
                    src: &layouts[2 * t],
                    dst: &layouts[2 * t + 1],
                    srcOffset: 0,
                    dstOffset: 0,
                    name: std::ptr::null(),
                    dstDtype: NCCL_RESHARD_UNDEF_INT,
                    quant: std::ptr::null(),
                    scaleOffset: 0,
                };
                for (d, &n) in spec.shape.iter().enumerate() {
                    c.shape[d] = n as i64;
                }
                c
            })
            .collect();
        let nodes: Vec<c_int> = match &config.topology {
            Topology::NodeTable(table) => table.iter().map(|&n| n as c_int).collect(),
            _ => Vec::new(),
        };
        let config = ncclReshardConfig_t {
            size: std::mem::size_of::<ncclReshardConfig_t>(),
            magic: NCCL_RESHARD_CONFIG_MAGIC,
            version: NCCL_RESHARD_VERSION_CODE as u32,
            mode: match config.mode {
                Mode::Groupable => ncclReshardMode_t::ncclReshardModeGroupable,
                Mode::Staged => ncclReshardMode_t::ncclReshardModeStaged,
                Mode::Auto => ncclReshardMode_t::ncclReshardModeAuto,
            } as c_int,
            ranksPerNode: match config.topology {
                Topology::RanksPerNode(n) => n as c_int,
                _ => 0,
            },
            nodeOfRank: if nodes.is_empty() {
                std::ptr::null()
            } else {
                nodes.as_ptr()
            },
            nodeOfRankCount: nodes.len() as c_int,
            splitMinBytes: config.split_min_bytes as usize,
            maxStagingBytes: 0,
            rounds: config.rounds as c_int,
            relay: c_int::from(config.relay),
            timeoutMs: NCCL_RESHARD_UNDEF_INT,
            failedRanks: std::ptr::null(),
            failedRankCount: 0,
            senderBarrier: match config.sender_barrier {
                None => NCCL_RESHARD_UNDEF_INT,
                Some(on) => c_int::from(on),
            },
        };
        Descriptors {
            _ranks: ranks,
            _strides: strides,
            _layouts: layouts,
            _nodes: nodes,
            tensors,
            config,
        }
    }
}

fn c_layout(layout: &Layout, ranks: &[c_int], strides: Option<&Vec<i64>>) -> ncclReshardLayout_t {
    let mut l = ncclReshardLayout_t {
        size: std::mem::size_of::<ncclReshardLayout_t>(),
        version: NCCL_RESHARD_VERSION_CODE as u32,
        meshNdim: layout.mesh.ndim() as c_int,
        meshShape: [0; NCCL_RESHARD_MAX_DIMS],
        ranks: ranks.as_ptr(),
        firstRank: 0,
        placements: [ncclReshardPlacement_t::default(); NCCL_RESHARD_MAX_DIMS],
        strides: strides.map_or(std::ptr::null(), |s| s.as_ptr()),
    };
    for (a, (&n, p)) in layout
        .mesh
        .shape()
        .iter()
        .zip(&layout.placements)
        .enumerate()
    {
        l.meshShape[a] = n as i64;
        l.placements[a] = match *p {
            Placement::Replicate => ncclReshardPlacement_t::default(),
            Placement::Shard(dim) => ncclReshardPlacement_t {
                kind: ncclReshardPlacementKind_t::ncclReshardShard as c_int,
                dim: dim as c_int,
                splitFactor: 0,
            },
            Placement::StridedShard { dim, split_factor } => ncclReshardPlacement_t {
                kind: ncclReshardPlacementKind_t::ncclReshardStridedShard as c_int,
                dim: dim as c_int,
                splitFactor: split_factor as i64,
            },
            Placement::ShardBlocks { dim, block } => ncclReshardPlacement_t {
                kind: ncclReshardPlacementKind_t::ncclReshardShardBlocks as c_int,
                dim: dim as c_int,
                splitFactor: block as i64,
            },
        };
    }
    l
}

/// Every rank's memory, per tensor: its source view and its destination view (empty when the
/// rank has none), exactly as `ncclreshard_tools::check` fills them.
#[derive(Clone, PartialEq)]
struct Memory {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
}

fn initial_memory(specs: &[TensorSpec], rank: u32) -> Memory {
    let mut m = Memory {
        src: Vec::new(),
        dst: Vec::new(),
    };
    for (t, spec) in specs.iter().enumerate() {
        m.src.push(
            source_view_bytes(spec, t as u32, rank)
                .unwrap()
                .unwrap_or_default(),
        );
        m.dst.push(
            destination_view_bytes(spec, rank)
                .unwrap()
                .unwrap_or_default(),
        );
    }
    m
}

/// A rank's plan read back through the C ABI.
struct RankExport {
    rank: u32,
    transfers: Vec<ncclReshardTransfer_t>,
    info: ncclReshardPlanInfo_t,
}

/// Creates `rank`'s plan with its views one after another (7 spare bytes between them, so
/// offsets relative to the views and to the buffers differ) and reads its transfers.
fn export_rank(d: &mut Descriptors, memory: &Memory, rank: u32) -> RankExport {
    let (mut src_at, mut dst_at) = (3usize, 5usize);
    for (t, c) in d.tensors.iter_mut().enumerate() {
        c.srcOffset = src_at;
        c.dstOffset = dst_at;
        src_at += memory.src[t].len() + 7;
        dst_at += memory.dst[t].len() + 7;
    }
    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
    // SAFETY: the descriptors and everything they point to are alive and valid.
    let created = unsafe {
        ncclReshardPlanCreate(
            &mut plan,
            d.tensors.len() as c_int,
            d.tensors.as_ptr(),
            rank as c_int,
            &d.config,
        )
    };
    assert_eq!(created, 0, "rank {rank}: {}", last_error());
    let mut count: c_int = -1;
    // SAFETY: a live plan; a NULL array asks for the count only.
    assert_eq!(
        unsafe { ncclReshardPlanGetTransfers(plan, std::ptr::null_mut(), 0, &mut count) },
        0
    );
    let mut transfers = vec![
        ncclReshardTransfer_t {
            size: std::mem::size_of::<ncclReshardTransfer_t>(),
            ..Default::default()
        };
        count as usize
    ];
    let mut written: c_int = -1;
    // SAFETY: `transfers` holds `count` initialised structs (an empty Vec's pointer is never
    // read: there is nothing to write).
    let got =
        unsafe { ncclReshardPlanGetTransfers(plan, transfers.as_mut_ptr(), count, &mut written) };
    assert_eq!(got, 0, "{}", last_error());
    assert_eq!(written, count);
    let mut info = ncclReshardPlanInfo_t {
        size: std::mem::size_of::<ncclReshardPlanInfo_t>(),
        ..Default::default()
    };
    // SAFETY: a live plan and a full-size info struct; the plan is destroyed once.
    unsafe {
        assert_eq!(ncclReshardPlanGetInfo(plan, &mut info), 0);
        assert_eq!(ncclReshardPlanDestroy(plan), 0);
    }
    RankExport {
        rank,
        transfers,
        info,
    }
}

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(ncclReshardGetLastError()) }
        .to_string_lossy()
        .into_owned()
}

/// Everything about a transfer but the side it is seen from (`kind`, `peer`), for comparing a
/// send with its receive.
fn shared_fields(t: &ncclReshardTransfer_t) -> String {
    let t = ncclReshardTransfer_t {
        kind: 0,
        peer: 0,
        ..*t
    };
    format!("{t:?}")
}

/// Calls `f(source byte, destination byte)` for every byte a transfer copies, in its order.
fn for_each_byte(t: &ncclReshardTransfer_t, mut f: impl FnMut(usize, usize)) {
    let n = t.copyNdim as usize;
    let mut index = vec![0i64; n];
    loop {
        let s = t.srcOffset as i64 + (0..n).map(|k| index[k] * t.srcStride[k]).sum::<i64>();
        let d = t.dstOffset as i64 + (0..n).map(|k| index[k] * t.dstStride[k]).sum::<i64>();
        for b in 0..t.chunkBytes as usize {
            f(s as usize + b, d as usize + b);
        }
        let mut k = n;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            index[k] += 1;
            if index[k] < t.count[k] {
                break;
            }
            index[k] = 0;
        }
    }
}

/// One exported transfer as a unit of work: a send with its matching receive, or a local copy.
struct Step {
    round: u32,
    sender: usize,
    receiver: usize,
    transfer: ncclReshardTransfer_t,
}

fn run_step(step: &Step, memory: &mut [Memory]) {
    let t = &step.transfer;
    let tensor = t.tensor as usize;
    // The sender's bytes, copied out first (a transfer never reads what it writes).
    let from = if t.srcView == FROM_DESTINATION {
        memory[step.sender].dst[tensor].clone()
    } else {
        memory[step.sender].src[tensor].clone()
    };
    let to = &mut memory[step.receiver].dst[tensor];
    for_each_byte(t, |s, d| to[d] = from[s]);
}

/// How a test runs the steps.
#[derive(Clone, Copy, Debug)]
enum Order {
    /// Round by round, each round's steps in list order.
    Rounds,
    /// Any step whose ranks have completed every receive of earlier rounds (the header's
    /// rule), picked at random among those.
    Random(u64),
    /// Against the rule: the latest round first.
    LatestRoundFirst,
}

/// Pairs every send with its receive (checking that they agree) and lists the local copies.
fn steps(exports: &[RankExport]) -> Vec<Step> {
    let index: BTreeMap<u32, usize> = exports
        .iter()
        .enumerate()
        .map(|(i, e)| (e.rank, i))
        .collect();
    // Per (sender, receiver, round): the sends and the receives, in list order.
    type Lists<'a> = BTreeMap<
        (u32, u32, c_int),
        (
            Vec<&'a ncclReshardTransfer_t>,
            Vec<&'a ncclReshardTransfer_t>,
        ),
    >;
    let mut pairs: Lists = BTreeMap::new();
    let mut out = Vec::new();
    for e in exports {
        for t in &e.transfers {
            let peer = t.peer as u32;
            match t.kind {
                SEND => pairs.entry((e.rank, peer, t.round)).or_default().0.push(t),
                RECV => pairs.entry((peer, e.rank, t.round)).or_default().1.push(t),
                LOCAL => {
                    assert_eq!(peer, e.rank, "a local copy's peer is the rank");
                    assert_eq!(t.round, 0, "rank {}: local copies run in round 0", e.rank);
                    assert_ne!(
                        t.srcView, FROM_DESTINATION,
                        "local copies read the source view"
                    );
                    out.push(Step {
                        round: 0,
                        sender: index[&e.rank],
                        receiver: index[&e.rank],
                        transfer: *t,
                    });
                }
                other => panic!("rank {}: kind {other}", e.rank),
            }
        }
    }
    for ((from, to, round), (sends, recvs)) in pairs {
        let sent: Vec<String> = sends.iter().map(|t| shared_fields(t)).collect();
        let received: Vec<String> = recvs.iter().map(|t| shared_fields(t)).collect();
        assert_eq!(
            sent, received,
            "rank {from} → rank {to}, round {round}: the sender's and the receiver's lists differ"
        );
        for t in sends {
            out.push(Step {
                round: round as u32,
                sender: index[&from],
                receiver: index[&to],
                transfer: *t,
            });
        }
    }
    out
}

/// Runs the steps in `order` over `memory`.
fn execute(steps: &[Step], memory: &mut [Memory], order: Order) {
    match order {
        Order::Rounds | Order::LatestRoundFirst => {
            let mut sorted: Vec<&Step> = steps.iter().collect();
            sorted.sort_by_key(|s| s.round);
            if let Order::LatestRoundFirst = order {
                sorted.reverse();
            }
            for s in sorted {
                run_step(s, memory);
            }
        }
        Order::Random(seed) => {
            // Receives not yet done, per rank and round.
            let mut open: Vec<BTreeMap<u32, usize>> = vec![BTreeMap::new(); memory.len()];
            for s in steps.iter().filter(|s| s.sender != s.receiver) {
                *open[s.receiver].entry(s.round).or_default() += 1;
            }
            let may_start = |open: &[BTreeMap<u32, usize>], rank: usize, round: u32| {
                open[rank]
                    .keys()
                    .next()
                    .map_or(true, |&first| first >= round)
            };
            let mut left: Vec<&Step> = steps.iter().collect();
            let mut state = seed | 1;
            while !left.is_empty() {
                let ready: Vec<usize> = (0..left.len())
                    .filter(|&i| {
                        may_start(&open, left[i].sender, left[i].round)
                            && may_start(&open, left[i].receiver, left[i].round)
                    })
                    .collect();
                assert!(
                    !ready.is_empty(),
                    "no transfer may start: the rule deadlocks"
                );
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let s = left.swap_remove(ready[(state % ready.len() as u64) as usize]);
                run_step(s, memory);
                if s.sender != s.receiver {
                    let n = open[s.receiver].get_mut(&s.round).expect("an open receive");
                    *n -= 1;
                    if *n == 0 {
                        open[s.receiver].remove(&s.round);
                    }
                }
            }
        }
    }
}

/// The first destination view that does not hold what it must, if any.
fn wrong_view(specs: &[TensorSpec], ranks: &[u32], memory: &[Memory]) -> Option<String> {
    for (i, &rank) in ranks.iter().enumerate() {
        for (t, spec) in specs.iter().enumerate() {
            if let Err(e) = verify_destination_view(spec, t as u32, rank, &memory[i].dst[t]) {
                return Some(e.message);
            }
        }
    }
    None
}

/// Checks that the transfers carry the program's bytes per peer and round (and locally), and
/// add up to the plan info.
fn check_against_program(e: &RankExport, program: &RankProgram) {
    let mut exported: BTreeMap<(c_int, u32, c_int), u64> = BTreeMap::new();
    let mut local = 0;
    for t in &e.transfers {
        if t.kind == LOCAL {
            local += t.bytes;
        } else {
            *exported
                .entry((t.kind, t.peer as u32, t.round))
                .or_default() += t.bytes;
        }
    }
    let mut messages: BTreeMap<(c_int, u32, c_int), u64> = BTreeMap::new();
    for round in program.rounds() {
        for (kind, list) in [(SEND, round.sends), (RECV, round.recvs)] {
            for m in list {
                *messages
                    .entry((kind, m.peer, round.round as c_int))
                    .or_default() += m.bytes;
            }
        }
    }
    assert_eq!(
        exported, messages,
        "rank {}: bytes per (kind, peer, round): transfers vs program",
        e.rank
    );
    assert_eq!(local, program.bytes_copied_locally(), "rank {}", e.rank);
    let sum = |kind| {
        e.transfers
            .iter()
            .filter(|t| t.kind == kind)
            .map(|t| t.bytes)
            .sum::<u64>()
    };
    assert_eq!(
        (sum(SEND), sum(RECV), sum(LOCAL)),
        (e.info.bytesSent, e.info.bytesReceived, e.info.bytesCopied),
        "rank {}: transfers vs plan info",
        e.rank
    );
    // Listed by round.
    assert!(
        e.transfers.windows(2).all(|w| w[0].round <= w[1].round),
        "rank {}: transfers out of round order",
        e.rank
    );
}

/// Checks the data description of every transfer against the finished destination: the
/// parts of a block tile its bytes, and byte k of a transfer is byte `blockOffset + k` of the
/// block's elements in row-major box order (each element's value depends on its global index
/// only).
fn check_boxes(specs: &[TensorSpec], exports: &[RankExport], ranks: &[u32], memory: &[Memory]) {
    let at = |rank: u32| {
        ranks
            .iter()
            .position(|&r| r == rank)
            .expect("a planned rank")
    };
    for e in exports {
        // Per block (kind, peer, tensor, box): (offset, bytes, block bytes) of its parts.
        type Parts = BTreeMap<(c_int, c_int, c_int, Vec<i64>), Vec<(u64, u64, u64)>>;
        let mut blocks = Parts::new();
        for t in &e.transfers {
            let ndim = t.ndim as usize;
            let spec = &specs[t.tensor as usize];
            assert_eq!(ndim, spec.shape.len());
            let size = u64::from(spec.dtype.size());
            let elements: i64 = t.globalCount[..ndim].iter().product();
            assert_eq!(
                t.blockBytes,
                elements as u64 * size,
                "rank {}: {t:?}",
                e.rank
            );
            let mut key: Vec<i64> = t.globalStart[..ndim].to_vec();
            key.extend_from_slice(&t.globalCount[..ndim]);
            blocks
                .entry((t.kind, t.peer, t.tensor, key))
                .or_default()
                .push((t.blockOffset, t.bytes, t.blockBytes));
            if t.kind == RECV {
                continue; // the same fields as its send, checked from the sender's list
            }
            let receiver = if t.kind == LOCAL {
                e.rank
            } else {
                t.peer as u32
            };
            let dst = &memory[at(receiver)].dst[t.tensor as usize];
            let strides = row_major_strides(&spec.shape);
            let mut k = 0u64;
            for_each_byte(t, |_, d| {
                let p = t.blockOffset + k;
                k += 1;
                let (mut element, byte) = (p / size, (p % size) as usize);
                let mut global = 0u64;
                for dim in (0..ndim).rev() {
                    let n = t.globalCount[dim] as u64;
                    global += (t.globalStart[dim] as u64 + element % n) * strides[dim];
                    element /= n;
                }
                let want = element_value(t.tensor as u32, global).to_le_bytes()[byte];
                assert_eq!(
                    dst[d], want,
                    "rank {}: byte {} of the block of {t:?} (global element {global})",
                    e.rank, p
                );
            });
        }
        for (key, mut parts) in blocks {
            parts.sort_unstable();
            let mut next = 0;
            for &(offset, bytes, _) in &parts {
                assert_eq!(offset, next, "rank {}: block {key:?}: {parts:?}", e.rank);
                next += bytes;
            }
            assert_eq!(
                next, parts[0].2,
                "rank {}: block {key:?}: {parts:?}",
                e.rank
            );
        }
    }
}

/// Every rank's initial memory and its plan read back through the C ABI.
fn export_all(
    specs: &[TensorSpec],
    config: &Config,
    ranks: &[u32],
) -> (Vec<Memory>, Vec<RankExport>) {
    let memory: Vec<Memory> = ranks.iter().map(|&r| initial_memory(specs, r)).collect();
    let mut descriptors = Descriptors::new(specs, config);
    let exports = ranks
        .iter()
        .zip(&memory)
        .map(|(&r, m)| export_rank(&mut descriptors, m, r))
        .collect();
    (memory, exports)
}

/// Everything a case checks; returns the exports for case-specific assertions.
fn check_export(specs: &[TensorSpec], config: &Config) -> Vec<RankExport> {
    let planner = Planner::new(specs.to_vec(), config.clone()).expect("a valid plan");
    let programs: Result<Vec<RankProgram>, _> = planner
        .ranks()
        .iter()
        .map(|&r| planner.rank_program(r))
        .collect();
    let programs = match programs {
        Ok(p) => p,
        // Regions interleaved element by element: groupable mode refuses them, auto takes them.
        Err(e) if config.mode == Mode::Groupable && e.message.contains("use auto") => {
            let auto = Config {
                mode: Mode::Auto,
                ..config.clone()
            };
            return check_export(specs, &auto);
        }
        Err(e) => panic!("{e}"),
    };
    let ranks = planner.ranks();
    // The program a plan runs (rank_program) is the one its exported transfers form.
    for (&r, program) in ranks.iter().zip(&programs) {
        let blocks = planner.rank_blocks(r).unwrap();
        let from_blocks = planner.program_from_blocks(r, &blocks).unwrap();
        assert_eq!(&from_blocks, program, "rank {r}");
    }
    let (before, exports) = export_all(specs, config, &ranks);
    for (e, p) in exports.iter().zip(&programs) {
        check_against_program(e, p);
    }
    let steps = steps(&exports);
    for order in [Order::Rounds, Order::Random(0x5eed), Order::Random(97)] {
        let mut memory = before.clone();
        execute(&steps, &mut memory, order);
        if let Some(wrong) = wrong_view(specs, &ranks, &memory) {
            panic!("{order:?}: {wrong}");
        }
        for (m, b) in memory.iter().zip(&before) {
            assert!(m.src == b.src, "a source view changed");
        }
        if let Order::Rounds = order {
            check_boxes(specs, &exports, &ranks, &memory);
        }
    }
    exports
}

/// True when running the steps latest round first leaves some destination wrong.
fn breaks_against_the_rule(specs: &[TensorSpec], config: &Config) -> bool {
    let ranks = Planner::new(specs.to_vec(), config.clone())
        .unwrap()
        .ranks();
    let (mut memory, exports) = export_all(specs, config, &ranks);
    execute(&steps(&exports), &mut memory, Order::LatestRoundFirst);
    wrong_view(specs, &ranks, &memory).is_some()
}

// Fixed cases.

fn layout(shape: &[u64], first: u32, placements: &[Placement]) -> Layout {
    Layout::new(
        Mesh::contiguous(shape.to_vec(), first).unwrap(),
        placements.to_vec(),
    )
}

/// TP2 (ranks 0-1, Shard(1)) → TP2 × DP4 (ranks 8-15, [Replicate, Shard(0)]): with 4 ranks
/// per node the two destination nodes hold two replicas of each shard (the case).
fn tp2_to_tp2_dp4() -> TensorSpec {
    TensorSpec {
        shape: vec![96, 64],
        dtype: DType::Bfloat16,
        src: layout(&[2], 0, &[Placement::Shard(1)]),
        dst: layout(&[4, 2], 8, &[Placement::Replicate, Placement::Shard(0)]),
    }
}

fn relayed(rounds: u32) -> Config {
    Config {
        mode: Mode::Auto,
        topology: Topology::RanksPerNode(4),
        split_min_bytes: 64,
        rounds,
        ..Default::default()
    }
}

#[test]
fn relayed_plans_run_from_the_export_alone() {
    let spec = tp2_to_tp2_dp4();
    for (mode, rounds) in [(Mode::Auto, 0), (Mode::Auto, 3), (Mode::Staged, 2)] {
        let config = Config {
            mode,
            ..relayed(rounds)
        };
        let exports = check_export(std::slice::from_ref(&spec), &config);
        // Ranks 8-15 hold no source view, yet forward what they received: from their
        // destination view, in a later round than it arrived.
        for e in exports.iter().filter(|e| e.rank >= 8) {
            let forwards: Vec<&ncclReshardTransfer_t> =
                e.transfers.iter().filter(|t| t.kind == SEND).collect();
            assert!(!forwards.is_empty(), "rank {} forwards", e.rank);
            let first_receive = e
                .transfers
                .iter()
                .filter(|t| t.kind == RECV)
                .map(|t| t.round)
                .min()
                .unwrap();
            for t in forwards {
                assert_eq!(t.srcView, FROM_DESTINATION, "rank {}: {t:?}", e.rank);
                assert!(t.round > first_receive, "rank {}: {t:?}", e.rank);
            }
        }
        assert!(
            breaks_against_the_rule(std::slice::from_ref(&spec), &config),
            "{config:?}: forwarding before the data arrived went unnoticed"
        );
    }
}

#[test]
fn late_unpack_arenas_give_way_to_the_staging_limit() {
    // Column shards into row shards, relayed on node 1: node-mates receive what a relay
    // forwards into staging and nothing later reads what they unpack (late unpacks, with two
    // arenas of their own). Under a limit the arenas would pass, the plan drops them and keeps
    // the same messages.
    let spec = tp2_to_tp2_dp4();
    let config = relayed(4);
    let planner = Planner::new(vec![spec.clone()], config.clone()).unwrap();
    let rank = (8..16)
        .find(|&r| {
            let p = planner.rank_program(r).unwrap();
            p.has_late_unpacks()
        })
        .expect("a rank with late unpacks");
    let overlapped = planner.rank_program(rank).unwrap();
    let sequential = planner.rank_program_sequential(rank).unwrap();
    assert!(sequential.staging_bytes < overlapped.staging_bytes);
    check_late_unpacks(&overlapped);
    // The same messages (forwards may read the arena their data arrived in instead).
    for (a, b) in [
        (&overlapped.sends, &sequential.sends),
        (&overlapped.recvs, &sequential.recvs),
    ] {
        assert!(
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| (x.peer, x.bytes) == (y.peer, y.bytes))
        );
    }
    let memory = initial_memory(std::slice::from_ref(&spec), rank);
    for (limit, staging) in [
        (0, overlapped.staging_bytes),
        (overlapped.staging_bytes, overlapped.staging_bytes),
        (sequential.staging_bytes, sequential.staging_bytes),
    ] {
        let mut d = Descriptors::new(std::slice::from_ref(&spec), &config);
        d.config.maxStagingBytes = limit as usize;
        let export = export_rank(&mut d, &memory, rank);
        assert_eq!(export.info.stagingBytes as u64, staging, "limit {limit}");
    }
    // Below what the rounds need anyway: refused, naming the limit.
    let mut d = Descriptors::new(std::slice::from_ref(&spec), &config);
    d.config.maxStagingBytes = (sequential.staging_bytes - 1) as usize;
    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
    // SAFETY: the descriptors and everything they point to are alive and valid.
    let created = unsafe {
        ncclReshardPlanCreate(&mut plan, 1, d.tensors.as_ptr(), rank as c_int, &d.config)
    };
    assert_ne!(created, 0);
    assert!(plan.is_null());
    assert!(last_error().contains("staging"), "{}", last_error());
}

#[test]
fn converting_plans_give_their_arenas_way_to_the_staging_limit_too() {
    // Defect: the program without late unpacks of a plan whose tensors convert on the way
    // still had them (the overlap pass also ran inside the conversions), so a limit below the
    // arenas refused the plan instead of dropping them. Through the Rust plan object, which is
    // what ncclReshardPlanCreate runs.
    let spec = tp2_to_tp2_dp4();
    let config = relayed(4);
    let fp8 = Conversion::cast(DType::Float8E4M3);
    let plan = |rank: u32, limit: u64| {
        let tensor = PlanTensor {
            conversion: Some(fp8.clone()),
            ..PlanTensor::new(spec.clone())
        };
        Plan::new(
            vec![tensor],
            rank,
            config.clone(),
            StagingLimit::new(limit),
            NcclTransport::LIMITS,
        )
    };
    let planner =
        Planner::with_conversions(vec![spec.clone()], vec![Some(fp8.clone())], config.clone())
            .unwrap();
    let rank = (8..16)
        .find(|&r| planner.rank_program(r).unwrap().has_late_unpacks())
        .expect("a rank with late unpacks");
    let overlapped = planner.rank_program(rank).unwrap();
    let sequential = planner.rank_program_sequential(rank).unwrap();
    assert!(!sequential.has_late_unpacks());
    assert!(sequential.staging_bytes < overlapped.staging_bytes);
    assert_eq!(plan(rank, 0).unwrap().program().as_ref(), &overlapped);
    let needs = |p: &RankProgram| p.staging_bytes + p.work_bytes;
    let limited = plan(rank, needs(&sequential)).unwrap();
    assert_eq!(limited.program().as_ref(), &sequential);
    let err = plan(rank, needs(&sequential) - 1).err().expect("refused");
    assert!(err.message.contains("bytes of staging on rank"), "{err}");
}

#[test]
fn relayed_into_a_strided_view_over_several_rounds() {
    // TP1 → DP8 on one node: one replica takes each chunk from the source and forwards it to
    // the other seven, into the left half of a fused [40, 48] buffer.
    let spec = TensorSpec {
        shape: vec![40, 24],
        dtype: DType::Float32,
        src: layout(&[1], 0, &[Placement::Replicate]),
        dst: layout(&[8], 8, &[Placement::Replicate]).with_strides(vec![48, 1]),
    };
    let config = Config {
        topology: Topology::RanksPerNode(8),
        split_min_bytes: 32,
        rounds: 4,
        ..relayed(4)
    };
    check_export(std::slice::from_ref(&spec), &config);
    assert!(breaks_against_the_rule(
        std::slice::from_ref(&spec),
        &config
    ));
}

#[test]
fn rounds_cut_blocks_into_pieces_that_still_add_up() {
    // Several tensors, colocated ranks and 5 rounds with tiny chunks: blocks are cut at byte
    // positions, inside elements too.
    let tensors = vec![
        TensorSpec {
            shape: vec![64, 32],
            dtype: DType::Float16,
            src: layout(&[2, 2], 0, &[Placement::Replicate, Placement::Shard(0)]),
            dst: layout(&[4], 0, &[Placement::Shard(1)]),
        },
        TensorSpec {
            shape: vec![33, 17],
            dtype: DType::Int8,
            src: layout(&[4], 0, &[Placement::Shard(0)]),
            dst: layout(&[2, 2], 0, &[Placement::Shard(1), Placement::Replicate])
                .with_strides(vec![20, 1]),
        },
        TensorSpec {
            shape: vec![128],
            dtype: DType::Float64,
            src: layout(&[2], 2, &[Placement::Shard(0)]),
            dst: layout(&[4], 0, &[Placement::Replicate]),
        },
    ];
    for split_min_bytes in [3, 16] {
        let config = Config {
            mode: Mode::Auto,
            topology: Topology::RanksPerNode(2),
            split_min_bytes,
            rounds: 5,
            ..Default::default()
        };
        let exports = check_export(&tensors, &config);
        let cut = exports
            .iter()
            .flat_map(|e| &e.transfers)
            .filter(|t| t.bytes < t.blockBytes)
            .count();
        assert!(
            cut > 0,
            "split_min_bytes {split_min_bytes}: no block was cut"
        );
        let size_of =
            |t: &ncclReshardTransfer_t| u64::from(tensors[t.tensor as usize].dtype.size());
        if split_min_bytes == 3 {
            assert!(
                exports
                    .iter()
                    .flat_map(|e| &e.transfers)
                    .any(|t| t.blockOffset % size_of(t) != 0),
                "some piece starts inside an element"
            );
        }
        let locals = exports
            .iter()
            .flat_map(|e| &e.transfers)
            .filter(|t| t.kind == LOCAL);
        assert!(locals.count() > 0, "colocated ranks copy locally");
    }
}

#[test]
fn groupable_and_staged_plans_with_strided_views() {
    // TP2 on dim 1 → one replica (rows interleave both sources) with a padded destination,
    // and a strided source.
    let spec = TensorSpec {
        shape: vec![6, 10],
        dtype: DType::Float32,
        src: layout(&[2], 0, &[Placement::Shard(1)]).with_strides(vec![1, 7]),
        dst: layout(&[1], 2, &[Placement::Replicate]).with_strides(vec![12, 1]),
    };
    for (mode, rounds) in [(Mode::Groupable, 0), (Mode::Staged, 0), (Mode::Staged, 3)] {
        let config = Config {
            mode,
            split_min_bytes: 8,
            rounds,
            ..Default::default()
        };
        let exports = check_export(std::slice::from_ref(&spec), &config);
        if mode == Mode::Groupable {
            assert!(exports
                .iter()
                .flat_map(|e| &e.transfers)
                .all(|t| t.round == 0 && t.blockOffset == 0 && t.bytes == t.blockBytes));
        }
    }
}

/// Rank 8's plan of `tp2_to_tp2_dp4` under `config` and its transfers as the current struct.
fn rank_8_plan(config: &Config) -> (ncclReshardPlan_t, Vec<ncclReshardTransfer_t>) {
    let spec = tp2_to_tp2_dp4();
    let mut descriptors = Descriptors::new(std::slice::from_ref(&spec), config);
    let memory = initial_memory(std::slice::from_ref(&spec), 8);
    let full = export_rank(&mut descriptors, &memory, 8);
    let mut plan: ncclReshardPlan_t = std::ptr::null_mut();
    // SAFETY: valid descriptors (the offsets export_rank set for rank 8); the caller destroys
    // the plan.
    let created = unsafe {
        ncclReshardPlanCreate(
            &mut plan,
            1,
            descriptors.tensors.as_ptr(),
            8,
            &descriptors.config,
        )
    };
    assert_eq!(created, 0, "{}", last_error());
    (plan, full.transfers)
}

/// Asks for `n` transfers into structs of `slot` bytes; returns the result, the bytes of the
/// n slots and of one spare slot after them.
fn fill_old_structs(plan: ncclReshardPlan_t, n: usize, slot: usize) -> (c_int, Vec<u8>) {
    let mut words = vec![0xeeee_eeee_eeee_eeeeu64; ((n + 1) * slot).div_ceil(8)];
    let bytes = words.as_mut_ptr().cast::<u8>();
    // SAFETY: `words` spans n + 1 slots; slots are 8-byte multiples, so this is aligned.
    unsafe { std::ptr::write_unaligned(bytes.cast::<usize>(), slot) };
    let mut written: c_int = -1;
    // SAFETY: the array holds n structs of `slot` bytes each, as its first one says.
    let got = unsafe { ncclReshardPlanGetTransfers(plan, bytes.cast(), n as c_int, &mut written) };
    if got == 0 {
        assert_eq!(written as usize, n);
    }
    // SAFETY: plain bytes of `words`.
    let all = unsafe { std::slice::from_raw_parts(bytes, (n + 1) * slot) }.to_vec();
    (got, all)
}

#[test]
fn an_older_callers_smaller_structs_get_the_fields_they_know() {
    // Rounds without relays: a 0.1 struct describes every transfer (all read source views).
    let (plan, full) = rank_8_plan(&Config {
        relay: false,
        ..relayed(3)
    });
    let n = full.len();
    assert!(n > 1 && full.iter().any(|t| t.round > 0));
    let slot = OLD_SIZE;
    let (got, bytes) = fill_old_structs(plan, n, slot);
    assert_eq!(got, 0, "{}", last_error());
    for (i, want) in full.iter().enumerate() {
        let mut old = ncclReshardTransfer_t::default();
        // SAFETY: slot i holds `slot` bytes; `old` is larger.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes[i * slot..].as_ptr(),
                (&mut old as *mut ncclReshardTransfer_t).cast::<u8>(),
                slot,
            )
        };
        assert_eq!(old.size, slot);
        let known = |t: &ncclReshardTransfer_t| {
            format!(
                "{:?}",
                (
                    (
                        t.kind,
                        t.peer,
                        t.tensor,
                        t.ndim,
                        t.globalStart,
                        t.globalCount
                    ),
                    (t.srcOffset, t.dstOffset, t.chunkBytes, t.copyNdim, t.count),
                    (t.srcStride, t.dstStride, t.bytes),
                )
            )
        };
        assert_eq!(known(&old), known(want), "slot {i}");
        assert_eq!(
            (old.round, old.blockBytes),
            (0, 0),
            "past the old size: not written"
        );
    }
    assert!(
        bytes[n * slot..].iter().all(|&b| b == 0xee),
        "wrote past the caller's structs"
    );
    // Smaller than the 0.1 struct: refused, nothing written.
    let (got, bytes) = fill_old_structs(plan, n, slot - 8);
    assert_eq!(got, 4);
    assert!(last_error().contains(&format!("transfers[0].size is {}", slot - 8)));
    assert!(bytes[8..].iter().all(|&b| b == 0xee));
    // SAFETY: the plan is no longer used.
    unsafe { assert_eq!(ncclReshardPlanDestroy(plan), 0) };

    // With forwards the old struct cannot say which view a send reads: refused, not misread.
    let (plan, full) = rank_8_plan(&relayed(3));
    assert!(full.iter().any(|t| t.srcView == FROM_DESTINATION));
    let (got, bytes) = fill_old_structs(plan, full.len(), slot);
    assert_eq!(got, 5, "ncclInvalidUsage");
    assert!(
        last_error().contains("forwards relayed data"),
        "{}",
        last_error()
    );
    assert!(bytes[8..].iter().all(|&b| b == 0xee), "nothing written");
    // SAFETY: the plan is no longer used.
    unsafe { assert_eq!(ncclReshardPlanDestroy(plan), 0) };
}

// Random cases.

fn tensor() -> impl Strategy<Value = TensorSpec> {
    (
        prop_oneof![
            3 => prop::collection::vec(0u64..=12, 0..=3),
            1 => prop::collection::vec(1u64..=40, 1..=2),
        ],
        prop::sample::select(vec![DType::Int8, DType::Bfloat16, DType::Float32]),
        mesh(2, 4, 8, 3),
        mesh(2, 4, 8, 6),
    )
        .prop_flat_map(|(shape, dtype, src_mesh, dst_mesh)| {
            let ndim = shape.len();
            tensor_on(
                shape,
                dtype,
                layout_on(src_mesh, ndim),
                layout_on(dst_mesh, ndim),
            )
        })
}

fn config() -> impl Strategy<Value = Config> {
    (
        prop::sample::select(vec![Mode::Groupable, Mode::Staged, Mode::Auto]),
        // Relays need a topology: mostly one.
        prop_oneof![
            1 => Just(Topology::Unknown),
            2 => (1u32..=4).prop_map(Topology::RanksPerNode),
            1 => prop::collection::vec(0u32..3, 32).prop_map(Topology::NodeTable),
        ],
        prop::sample::select(vec![1u64, 3, 64, 1 << 20]),
        prop::sample::select(vec![0u32, 1, 2, 3, 5]),
        prop::bool::weighted(0.8),
    )
        .prop_map(|(mode, topology, split_min_bytes, rounds, relay)| Config {
            mode,
            topology,
            split_min_bytes,
            rounds,
            relay,
            ..Default::default()
        })
}

/// Every byte offset one side of `copy` covers.
fn copy_bytes(copy: &ncclreshard::plan::StridedCopy, src: bool) -> Vec<u64> {
    let mut out = Vec::new();
    if copy.chunk_bytes == 0 || copy.dims.iter().any(|d| d.count == 0) {
        return out;
    }
    let mut index = vec![0u64; copy.dims.len()];
    loop {
        let mut at = if src {
            copy.src.offset
        } else {
            copy.dst.offset
        };
        for (d, &i) in copy.dims.iter().zip(&index) {
            at += i * if src { d.src_stride } else { d.dst_stride };
        }
        out.extend(at..at + copy.chunk_bytes);
        if !ncclreshard::layout::next_index(&mut index, |d| copy.dims[d].count) {
            return out;
        }
    }
}

/// The late-unpack contract (docs/executor.md, "Overlapping unpacks"), byte by byte: what a
/// round's late unpacks write, no later round's pack or send reads; what they read of staging,
/// nothing writes in the next round, nor the packs of the round after (which run before the
/// executor waits for them); the last round has none. A forward reading the arena its data
/// arrived in (a pack reading staging, or a send reading staging no pack of its round writes)
/// reads only bytes a staging receive of the round before landed, which nothing of its own
/// round writes before it has read them (its packs; its receives land in other arenas).
fn check_late_unpacks(p: &RankProgram) {
    use ncclreshard::plan::Buffer;
    use std::collections::HashSet;
    let rounds = p.rounds();
    for (j, round) in rounds.iter().enumerate() {
        let packed: HashSet<u64> = round
            .packs
            .iter()
            .filter(|c| c.dst.buffer == Buffer::Staging)
            .flat_map(|c| copy_bytes(c, false))
            .collect();
        let mut read: Vec<u64> = round
            .packs
            .iter()
            .filter(|c| c.src.buffer == Buffer::Staging)
            .flat_map(|c| copy_bytes(c, true))
            .collect();
        let over = read.iter().find(|b| packed.contains(b));
        assert!(
            over.is_none(),
            "rank {} round {j} packs over staging byte {over:?} its own forwards read",
            p.rank
        );
        read.extend(
            round
                .sends
                .iter()
                .filter(|m| m.loc.buffer == Buffer::Staging)
                .flat_map(|m| m.loc.offset..m.loc.offset + m.bytes)
                .filter(|b| !packed.contains(b)),
        );
        if read.is_empty() {
            continue;
        }
        assert!(j > 0, "rank {}: round 0 forwards from staging", p.rank);
        let arrived: HashSet<u64> = rounds[j - 1]
            .recvs
            .iter()
            .filter(|m| m.loc.buffer == Buffer::Staging)
            .flat_map(|m| m.loc.offset..m.loc.offset + m.bytes)
            .collect();
        let landing: HashSet<u64> = round
            .recvs
            .iter()
            .filter(|m| m.loc.buffer == Buffer::Staging)
            .flat_map(|m| m.loc.offset..m.loc.offset + m.bytes)
            .collect();
        for b in read {
            assert!(
                arrived.contains(&b),
                "rank {} round {j} forwards staging byte {b} that no receive of the round before landed",
                p.rank
            );
            assert!(
                !landing.contains(&b),
                "rank {} round {j} receives over staging byte {b} it forwards",
                p.rank
            );
        }
    }
    assert!(p.rounds_are_consistent(), "rank {}", p.rank);
    if let Some(last) = rounds.last() {
        assert_eq!(
            last.late, 0,
            "rank {}: late unpacks in the last round",
            p.rank
        );
    }
    let key = |l: &ncclreshard::plan::Loc| {
        (
            l.buffer,
            if l.buffer == Buffer::Work {
                0
            } else {
                l.tensor
            },
        )
    };
    for (k, round) in rounds.iter().enumerate() {
        if round.late == 0 {
            continue;
        }
        let mut written = HashSet::new();
        let mut read = HashSet::new();
        for u in round.late_unpacks() {
            written.extend(copy_bytes(u, false).into_iter().map(|b| (key(&u.dst), b)));
            assert_eq!(u.src.buffer, Buffer::Staging);
            read.extend(copy_bytes(u, true));
        }
        for (j, later) in rounds.iter().enumerate().skip(k + 1) {
            for c in later.packs {
                for b in copy_bytes(c, true) {
                    assert!(
                        !written.contains(&(key(&c.src), b)),
                        "rank {} round {j} packs what round {k}'s late unpacks write",
                        p.rank
                    );
                }
                if j <= k + 2 && c.dst.buffer == Buffer::Staging {
                    for b in copy_bytes(c, false) {
                        assert!(
                            !read.contains(&b),
                            "rank {} round {j} packs over round {k}'s late staging",
                            p.rank
                        );
                    }
                }
            }
            for m in later.sends {
                for b in m.loc.offset..m.loc.offset + m.bytes {
                    assert!(
                        !written.contains(&(key(&m.loc), b)),
                        "rank {} round {j} sends what round {k}'s late unpacks write",
                        p.rank
                    );
                }
            }
            if j == k + 1 {
                for m in later
                    .recvs
                    .iter()
                    .filter(|m| m.loc.buffer == Buffer::Staging)
                {
                    for b in m.loc.offset..m.loc.offset + m.bytes {
                        assert!(
                            !read.contains(&b),
                            "rank {} round {j} receives over round {k}'s late staging",
                            p.rank
                        );
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Late unpacks keep their contract in random plans, with every receive they read in the
    /// arenas or, under a staging limit (`eighths` of the way from what the program without
    /// them needs to what all of them need), only some; the limit holds, and planning without
    /// them gives the same messages in the same order.
    #[test]
    fn random_plans_keep_the_late_unpack_contract(
        tensors in prop::collection::vec(tensor(), 1..=3),
        config in config(),
        eighths in 0u64..=8,
    ) {
        let planner = match Planner::new(tensors, config) {
            Ok(p) => p,
            Err(_) => return Ok(()),
        };
        for rank in 0..planner.ranks().iter().copied().max().map_or(0, |r| r + 1) {
            let all = planner.rank_program(rank).unwrap();
            let q = planner.rank_program_sequential(rank).unwrap();
            let limit = q.staging_bytes + (all.staging_bytes - q.staging_bytes) * eighths / 8;
            let p = planner.rank_program_within(rank, limit).unwrap();
            check_late_unpacks(&all);
            check_late_unpacks(&p);
            prop_assert!(p.staging_bytes <= limit, "rank {}: {} > {}", rank, p.staging_bytes, limit);
            prop_assert_eq!(p.sends.len(), q.sends.len());
            prop_assert!(p.sends.iter().zip(&q.sends).all(|(a, b)| a.peer == b.peer && a.bytes == b.bytes));
            prop_assert!(p.recvs.iter().zip(&q.recvs).all(|(a, b)| a.peer == b.peer && a.bytes == b.bytes));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    #[test]
    fn random_plans_run_from_the_export_alone(
        tensors in prop::collection::vec(tensor(), 1..=3),
        config in config(),
    ) {
        check_export(&tensors, &config);
    }
}
