//! `ncclreshard simulate`: estimated refit time on a cluster (reshard vs gather+broadcast vs
//! the physical lower bound), from the real programs of every rank.

use super::refit_setup::{self, RefitArgs, Views};
use super::{usage, Command};
use crate::args::{flag, value, Parsed};
use crate::out;
use crate::work;
use crate::Failure;
use ncclreshard::plan::StridedConvert;
use ncclreshard::quant::Conversion;
use ncclreshard::{Config, RankProgram};
use ncclreshard_tools::models::Refit;
use ncclreshard_tools::sim::{
    self, BoundKind, Cluster, Direction, LinkKind, LinkUse, LowerBound, M2nParams, M2nReport,
    MemoryUse, Schedule, SimOptions, SimReport, ENGINE_POSTPROCESS_S,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;

pub const COMMAND: Command = Command {
    name: "simulate",
    help: HELP,
    options: &[
        value("model"),
        value("train"),
        value("infer"),
        value("system"),
        value("cluster"),
        value("dtype"),
        value("infer-dtype"),
        value("experts"),
        value("views"),
        flag("colocated"),
        value("mode"),
        value("rounds"),
        flag("no-relay"),
        value("sender-barrier"),
        value("trials"),
        value("seed"),
        value("rank"),
        flag("json"),
    ],
    run,
};

const HELP: &str = r#"Estimate a weight refit on a cluster: reshard vs NCCL M2N vs gather+broadcast vs the floor

Usage: ncclreshard simulate --model NAME|FILE --train SPEC --infer SPEC [OPTIONS]

Builds the refit's tensors (training layout → inference layout), plans every rank's program
with the same planner users run, and runs them through the calibrated cluster model
(docs/simulator.md): achievable link speeds, NCCL's per-message, per-round and per-peer costs,
a rail-optimised fabric, copy speed by run length, memory, jitter (median and p90 over
--trials). Also NCCL M2N's hierarchical and direct algorithms and NeMo RL's gather+broadcast on
the same model, the physical floor (forwarding allowed) and the floor of direct plans. These
are simulations; `ncclreshard calibrate` shows how well the model reproduces published
measurements. Planning and simulating hundreds of ranks take a while (DeepSeek-V3's 512
ranks: about two minutes on 2 cores, a third of that with --trials 0); progress goes to stderr,
results to stdout.

Options:
  --model NAME|FILE  deepseek-v3, kimi-k2, qwen3-235b-a22b, qwen3-32b, llama-3.1-70b,
                     dsv3-toy, a HuggingFace config.json or an M2N *.model.json tensor listing
                     (required)
  --train SPEC       Megatron-style training parallelism: tp,cp,pp,dp,ep,etp (and fsdp), e.g.
                     pp16,ep16 (dp defaults to the smallest that fits ep) (required)
  --infer SPEC       vLLM-style inference parallelism: tp,dp[,ep], e.g. tp32,dp8 (required)
  --system FILE      An NCCL M2N system_configs/*.json instead of --train and --infer
  --cluster C        dgx-h100 (default), gb200-nvl72, or key=value pairs on top of a preset:
                     dgx-h100,nic_gbits=200,oversubscription=2,pxn=0 (every key and its
                     default: docs/simulator.md §1; `ideal` drops efficiencies and costs)
  --dtype NAME       Element type of the weights, torch's name (default bfloat16)
  --infer-dtype D    What inference stores, converted on the way (docs/quantization.md):
                     fp8-block128 (DeepSeek-V3's FP8: decoder linear weights in 128 × 128
                     blocks with FP32 scales), fp8-blockRxC, fp8-per-channel, or a dtype for
                     a plain cast. Also simulates the refit without conversion and reports
                     the bytes saved and the time ratio (JSON: "conversion")
  --experts E        stacked (default) or per-expert routed expert tensors
  --views V          Where each inference rank's destination views sit: separate (default:
                     one buffer each, as ncclReshardMulti with separate allocations) or packed
                     (back to back in tensor order in one buffer, as ncclReshard with offsets
                     in descriptor order: receives whose data lands on adjacent views land
                     in place, no unpack; docs/executor.md, "Receiving in place")
  --colocated        Inference runs on the training ranks (default: the ranks after them)
  --mode MODE        auto (default), staged or groupable
  --rounds N         Staged/auto: rounds to spread the data over (default 0: automatic)
  --no-relay         Send each replica its data across the network (no NVLink relays)
  --sender-barrier B auto (default), on or off: a node's sending-only ranks pass a barrier
                     of 8-byte messages among themselves before each round from the second
                     (docs/executor.md, "The senders' barrier"); auto: where a planner node
                     holds at least 9 of them (gb200-nvl72's 72-GPU domains, not dgx-h100's
                     nodes of 8). JSON: "sender_barrier", "barrier_members_max" (the largest
                     group, 0 for none)
  --trials N         Monte Carlo trials with jitter (default 5; 0: one run without jitter)
  --seed N           Seed of the trials (default 1)
  --rank R           Break down rank R's time (JSON: "critical_path", round by round in
                     its "rounds") instead of the rank that finishes last's
  --json             JSON output: reshard_s (median), reshard_p90_s, lower_bound_s (the
                     physical floor), direct_bound_s, m2n_hierarchical_s, m2n_direct_s,
                     gather_broadcast_s, peak_staging_bytes, setup_s, fits, ...
  -h, --help         Show this help

The planner is told that ranks sharing an NVLink domain share a node (8 on dgx-h100, 72 on
gb200-nvl72), so it prefers NVLink senders there. A plan whose staging and NCCL buffers do not
fit in a GPU's free memory is reported, not simulated (exit status 0, "fits": false).

Example:
  ncclreshard simulate --model deepseek-v3 --train pp16,ep16 --infer tp32,dp8 --cluster dgx-h100
"#;

/// Monte Carlo trials unless `--trials` says otherwise.
pub const DEFAULT_TRIALS: u32 = 5;

/// Every estimate of one refit, and what planning it took.
pub struct Simulation {
    pub cluster: Cluster,
    pub programs: Vec<RankProgram>,
    pub reshard: SimReport,
    /// With conversions: the same refit's reshard without them (every tensor in the training
    /// dtype), for the bytes and time the conversions save.
    pub unconverted: Option<SimReport>,
    /// M2N as its own benchmark runs it: one communicator per pipeline-stage pair.
    pub m2n_hierarchical: M2nReport,
    pub m2n_direct: M2nReport,
    /// M2N hierarchical on one communicator, one call per tensor in order (how NeMo RL and
    /// vLLM's `nccl_m2n` engine call it).
    pub m2n_one_comm: M2nReport,
    pub baseline: SimReport,
    pub bound: LowerBound,
    pub plan_s: f64,
    pub simulate_s: f64,
}

impl Simulation {
    /// The seconds of every method, in report order, with their names.
    pub fn methods(&self) -> [(&'static str, f64); 5] {
        [
            ("reshard (ncclreshard)", self.reshard.time_s),
            ("M2N hierarchical", complete(&self.m2n_hierarchical)),
            ("M2N direct", complete(&self.m2n_direct)),
            ("M2N one communicator", complete(&self.m2n_one_comm)),
            ("gather+broadcast", self.baseline.time_s),
        ]
    }
}

/// An M2N estimate's time, infinite when M2N cannot move every tensor of the refit.
fn complete(m2n: &M2nReport) -> f64 {
    m2n.complete_time().unwrap_or(f64::INFINITY)
}

/// `--trials N` and `--seed N`.
pub fn sim_options(parsed: &Parsed, command: &'static str) -> Result<SimOptions, Failure> {
    let trials = parsed
        .number::<u32>("trials")
        .map_err(|e| usage(command, e))?
        .unwrap_or(DEFAULT_TRIALS);
    let seed = parsed
        .number::<u64>("seed")
        .map_err(|e| usage(command, e))?
        .unwrap_or(1);
    Ok(SimOptions {
        trials,
        seed,
        rank: None,
    })
}

/// Simulates `refit` with `conversions` (one per tensor; `None`: it arrives as it is), with the
/// peers' methods and the bounds: the baselines move the tensors as trained, the floors count
/// each converted element at the smaller of its two sizes (`sim::lower_bound_converted`). With
/// any conversion, the reshard without them is simulated too ([`Simulation::unconverted`]).
pub fn simulate(
    refit: &Refit,
    conversions: &[Option<Conversion>],
    cluster: &Cluster,
    config: Config,
    options: &SimOptions,
    views: Views,
) -> Result<Simulation, Failure> {
    let unconverted = if conversions.iter().any(Option::is_some) {
        let none = vec![None; refit.tensors.len()];
        let planner = refit_setup::planner(&refit.tensors, &none, config.clone())?;
        let (programs, _) =
            refit_setup::plan_all(&planner, views, "planning ranks (no conversion)")?;
        let (report, _) = work::track("simulating (no conversion)", 0, |_| {
            sim::simulate_with(&programs, cluster, options)
        });
        Some(report)
    } else {
        None
    };
    let planner = refit_setup::planner(&refit.tensors, conversions, config)?;
    let (programs, planned) = refit_setup::plan_all(&planner, views, "planning ranks")?;
    let ((reshard, (m2n_hierarchical, m2n_direct, m2n_one_comm), baseline, bound), simulated) =
        work::track("simulating", 0, |_| {
            let peers = |params: &M2nParams, schedule: Schedule| {
                sim::m2n(&refit.names, &refit.tensors, cluster, params, schedule)
            };
            (
                sim::simulate_with(&programs, cluster, options),
                (
                    peers(&M2nParams::hierarchical(), Schedule::ModelBench),
                    peers(&M2nParams::direct(), Schedule::ModelBench),
                    peers(&M2nParams::hierarchical(), Schedule::OneCommunicator),
                ),
                sim::gather_broadcast(&refit.tensors, cluster),
                sim::lower_bound_converted(&refit.tensors, conversions, cluster),
            )
        });
    Ok(Simulation {
        cluster: cluster.clone(),
        programs,
        reshard,
        unconverted,
        m2n_hierarchical,
        m2n_direct,
        m2n_one_comm,
        baseline,
        bound,
        plan_s: planned.as_secs_f64(),
        simulate_s: simulated.as_secs_f64(),
    })
}

/// One side's NIC bytes (training or inference ranks), per direction.
#[derive(Serialize)]
pub struct SideNicJson {
    egress: SpreadJson,
    ingress: SpreadJson,
}

#[derive(Serialize)]
pub struct SpreadJson {
    max: u64,
    mean: f64,
    min: u64,
}

impl SideNicJson {
    /// The spread of `nic` (rank, egress, ingress; ranks absent carried nothing) over `ranks`.
    fn new(nic: &[(u32, u64, u64)], ranks: std::ops::Range<u32>) -> SideNicJson {
        let spread = |pick: fn(&(u32, u64, u64)) -> u64| {
            let values: Vec<u64> = ranks
                .clone()
                .map(|r| {
                    nic.binary_search_by_key(&r, |e| e.0)
                        .map_or(0, |at| pick(&nic[at]))
                })
                .collect();
            SpreadJson {
                max: values.iter().copied().max().unwrap_or(0),
                mean: values.iter().sum::<u64>() as f64 / values.len().max(1) as f64,
                min: values.iter().copied().min().unwrap_or(0),
            }
        };
        SideNicJson {
            egress: spread(|e| e.1),
            ingress: spread(|e| e.2),
        }
    }
}

/// [`sim::CriticalPath`] as `simulate --json` prints it, with the floor and jitter beside it.
#[derive(Serialize)]
pub struct CriticalJson {
    rank: u32,
    /// Sum of the parts: the run without jitter.
    nominal_s: f64,
    packs_s: f64,
    conversions_s: f64,
    waits_s: f64,
    /// Inside `waits_s`: at the senders' barriers ([`sim::CriticalPath::barrier_s`]).
    waits_barrier_s: f64,
    transfers_s: f64,
    /// Inside `transfers_s`: the rank's own bytes at rated speed on its busiest port, the
    /// per-message latencies no byte of the rank overlaps (per round, its pairs' shortest), and
    /// the rest: link efficiency (`transfers_efficiency_s`, the same bytes at achievable
    /// speed) and sharing links with other ranks' flows, incast and waiting for peers to
    /// reach the round (`transfers_sharing_s`), of which waiting for the last peer of each
    /// round to enter it (`transfers_sharing_peers_s`, [`sim::CriticalPath::peers_s`]) and
    /// the rest (`transfers_sharing_links_s`).
    transfers_rated_s: f64,
    transfers_latency_s: f64,
    transfers_sharing_and_efficiency_s: f64,
    transfers_efficiency_s: f64,
    transfers_sharing_s: f64,
    transfers_sharing_peers_s: f64,
    transfers_sharing_links_s: f64,
    unpacks_s: f64,
    late_tail_s: f64,
    /// `reshard_s - nominal_s`: what jitter adds to the median (with `--rank`, also how much
    /// later than that rank the run ends).
    jitter_s: f64,
    /// The physical floor, and how far above it the nominal run is.
    floor_s: f64,
    over_floor_s: f64,
    /// The same rank round by round ([`sim::CriticalRound`]).
    rounds: Vec<CriticalRoundJson>,
}

/// One round of the critical path's rank, as `simulate --json` prints it: when it entered the
/// round, was ready, was done; its transfers (`done_s - ready_s`) against its own bytes at
/// achievable speed (`own_s`); the peer that was ready last and how long after it; its unpacks
/// before the next round and beside it.
#[derive(Serialize)]
pub struct CriticalRoundJson {
    round: u32,
    entered_s: f64,
    ready_s: f64,
    /// Of `ready_s - entered_s`: at the senders' barriers before the round.
    barrier_s: f64,
    done_s: f64,
    transfers_s: f64,
    own_s: f64,
    last_peer: Option<u32>,
    last_peer_after_s: f64,
    unpack_s: f64,
    late_unpack_s: f64,
    flows: usize,
}

impl CriticalJson {
    fn new(c: &sim::CriticalPath, s: &Simulation) -> CriticalJson {
        let nominal =
            c.packs_s + c.conversions_s + c.waits_s + c.transfers_s + c.unpacks_s + c.late_tail_s;
        let sharing = (c.transfers_s - c.rated_s - c.latency_s - c.efficiency_s).max(0.0);
        let peers = c.peers_s.min(sharing);
        CriticalJson {
            rank: c.rank,
            nominal_s: nominal,
            packs_s: c.packs_s,
            conversions_s: c.conversions_s,
            waits_s: c.waits_s,
            waits_barrier_s: c.barrier_s,
            transfers_s: c.transfers_s,
            transfers_rated_s: c.rated_s,
            transfers_latency_s: c.latency_s,
            transfers_sharing_and_efficiency_s: (c.transfers_s - c.rated_s - c.latency_s).max(0.0),
            transfers_efficiency_s: c.efficiency_s,
            transfers_sharing_s: sharing,
            transfers_sharing_peers_s: peers,
            transfers_sharing_links_s: sharing - peers,
            unpacks_s: c.unpacks_s,
            late_tail_s: c.late_tail_s,
            jitter_s: s.reshard.time_s - nominal,
            floor_s: s.bound.time_s,
            over_floor_s: nominal - s.bound.time_s,
            rounds: c
                .rounds
                .iter()
                .map(|r| CriticalRoundJson {
                    round: r.round,
                    entered_s: r.entered_s,
                    ready_s: r.ready_s,
                    barrier_s: r.barrier_s,
                    done_s: r.done_s,
                    transfers_s: r.done_s - r.ready_s,
                    own_s: r.own_s,
                    last_peer: r.last_peer,
                    last_peer_after_s: r.last_peer_after_s,
                    unpack_s: r.unpack_s,
                    late_unpack_s: r.late_unpack_s,
                    flows: r.flows,
                })
                .collect(),
        }
    }
}

#[derive(Serialize)]
pub struct ClusterJson {
    name: String,
    gpus_per_node: u32,
    nvlink_domain: u32,
    nvlink_gbs: f64,
    nic_gbs: f64,
    nvlink_efficiency: f64,
    nic_efficiency: f64,
    nodes_per_leaf: u32,
    oversubscription: f64,
    pxn: bool,
    latency_us: f64,
    host_op_us: f64,
    p2p_channels_per_peer: u32,
    free_memory_bytes: u64,
}

impl ClusterJson {
    pub fn new(c: &Cluster, ranks: usize) -> ClusterJson {
        ClusterJson {
            name: c.name.clone(),
            gpus_per_node: c.gpus_per_node,
            nvlink_domain: c.nvlink_domain,
            nvlink_gbs: c.nvlink_bw / 1e9,
            nic_gbs: c.nic_bw / 1e9,
            nvlink_efficiency: c.nvlink_efficiency,
            nic_efficiency: c.nic_efficiency,
            nodes_per_leaf: c.nodes_per_leaf,
            oversubscription: c.oversubscription,
            pxn: c.pxn,
            latency_us: c.latency_s * 1e6,
            host_op_us: c.host_op_s * 1e6,
            p2p_channels_per_peer: c.p2p_channels_per_peer(ranks),
            free_memory_bytes: c.free_memory_bytes,
        }
    }
}

#[derive(Serialize)]
struct MemoryJson {
    rank: u32,
    staging_bytes: u64,
    nccl_buffer_bytes: u64,
    work_bytes: u64,
    free_bytes: u64,
    fits: bool,
}

#[derive(Serialize)]
struct LinkJson {
    rank: u32,
    /// "nvlink" or "nic".
    kind: &'static str,
    /// "egress" or "ingress".
    direction: &'static str,
    bytes: u64,
    busy_fraction: f64,
}

#[derive(Serialize)]
struct BoundJson {
    kind: &'static str,
    subject: u32,
    domains: Vec<u32>,
    bytes: u64,
    bandwidth_gbs: f64,
    time_s: f64,
}

#[derive(Serialize)]
struct BaselineJson {
    time_s: f64,
    bytes_total: u64,
    bytes_offnode: u64,
    messages_total: u64,
    messages_max_per_rank: u64,
    phases: BTreeMap<&'static str, f64>,
}

#[derive(Serialize)]
struct M2nJson {
    /// The time of the tensors M2N can move; the refit's `m2n_*_s` is null when it cannot
    /// move them all.
    time_s: f64,
    calls: u64,
    /// Tensors M2N cannot move (left out of `time_s`).
    skipped_tensors: usize,
    first_skipped: Option<String>,
    bytes_total: u64,
    host_s: f64,
}

impl M2nJson {
    fn new(r: &M2nReport) -> M2nJson {
        M2nJson {
            time_s: r.sim.time_s,
            calls: r.calls,
            skipped_tensors: r.skipped.len(),
            first_skipped: r.first_skipped.clone(),
            bytes_total: r.sim.bytes_total,
            host_s: r.sim.phase("host").unwrap_or(0.0),
        }
    }
}

/// Every method's time plus the engine post-processing every method pays.
#[derive(Serialize)]
pub struct WithPostprocessJson {
    engine_postprocess_s: f64,
    reshard_s: Option<f64>,
    m2n_hierarchical_s: Option<f64>,
    m2n_direct_s: Option<f64>,
    m2n_hierarchical_one_comm_s: Option<f64>,
    gather_broadcast_s: f64,
}

impl WithPostprocessJson {
    pub fn new(s: &Simulation) -> WithPostprocessJson {
        let post = ENGINE_POSTPROCESS_S;
        WithPostprocessJson {
            engine_postprocess_s: post,
            reshard_s: finite(s.reshard.time_s).map(|t| t + post),
            m2n_hierarchical_s: s.m2n_hierarchical.complete_time().map(|t| t + post),
            m2n_direct_s: s.m2n_direct.complete_time().map(|t| t + post),
            m2n_hierarchical_one_comm_s: s.m2n_one_comm.complete_time().map(|t| t + post),
            gather_broadcast_s: s.baseline.time_s + post,
        }
    }
}

#[derive(Serialize)]
struct Output {
    model: String,
    train: String,
    infer: String,
    train_ranks: [u32; 2],
    infer_ranks: [u32; 2],
    ranks: usize,
    colocated: bool,
    dtype: String,
    /// What inference stores (`--infer-dtype`, else `dtype`).
    infer_dtype: String,
    experts: &'static str,
    views: &'static str,
    mode: &'static str,
    /// `--sender-barrier`: auto, on or off.
    sender_barrier: &'static str,
    /// The most ranks passing one senders' barrier together (0: no rank passes one).
    barrier_members_max: usize,
    cluster: ClusterJson,
    tensors: usize,
    parameters: u64,
    model_bytes: u64,
    /// False when some rank's staging and NCCL buffers exceed its free memory: the reshard
    /// was not simulated and its times are null.
    fits: bool,
    /// Median over the trials (or the one run without jitter).
    reshard_s: Option<f64>,
    reshard_p90_s: Option<f64>,
    trials: u32,
    /// One-time costs before the first call (connections, NVRTC), not in `reshard_s`.
    setup_s: f64,
    /// NCCL M2N as its benchmark runs it (one communicator per pipeline-stage pair); null
    /// when M2N cannot move every tensor (`m2n_*.first_skipped` says why).
    m2n_hierarchical_s: Option<f64>,
    m2n_direct_s: Option<f64>,
    /// NCCL M2N hierarchical on one communicator, one call per tensor (NeMo RL, vLLM).
    m2n_hierarchical_one_comm_s: Option<f64>,
    gather_broadcast_s: f64,
    /// The physical floor (forwarding allowed).
    lower_bound_s: f64,
    /// The floor of direct plans (no forwarding between destination domains).
    direct_bound_s: f64,
    reshard_over_lower_bound: Option<f64>,
    m2n_hierarchical_over_reshard: Option<f64>,
    gather_broadcast_over_reshard: Option<f64>,
    with_engine_postprocess: WithPostprocessJson,
    bytes_total: u64,
    bytes_offnode: u64,
    bytes_local: u64,
    messages_total: u64,
    messages_max_per_rank: u64,
    messages_mean_per_rank: f64,
    bytes_max_per_rank: u64,
    staged_ranks: usize,
    staging_bytes_max: u64,
    /// The largest staging arena of any rank.
    peak_staging_bytes: u64,
    /// The rank needing the most device memory (staging plus NCCL buffers) and what is free.
    memory: Option<MemoryJson>,
    busiest_link: Option<LinkJson>,
    /// Bytes through each GPU's NIC, per side (training ranks, inference ranks) and direction:
    /// the largest, mean and smallest over the side's ranks (the run without jitter).
    nic_bytes: BTreeMap<&'static str, SideNicJson>,
    /// Where the time goes: the last rank's clock split into parts (the run without jitter;
    /// docs/simulator.md §7).
    critical_path: Option<CriticalJson>,
    /// Each round's busiest link against the busiest link's whole load (the run without
    /// jitter; docs/simulator.md §7).
    rounds_profile: Option<RoundsJson>,
    reshard_phases: BTreeMap<&'static str, f64>,
    m2n_hierarchical: M2nJson,
    m2n_direct: M2nJson,
    m2n_hierarchical_one_comm: M2nJson,
    gather_broadcast: BaselineJson,
    lower_bound_binding: String,
    direct_bound_binding: String,
    lower_bounds: Vec<BoundJson>,
    /// With `--infer-dtype`: what converting on the way changed.
    conversion: Option<ConversionJson>,
    plan_s: f64,
    simulate_s: f64,
}

/// A refit that converts on the way against the same refit without conversion.
#[derive(Serialize)]
pub struct ConversionJson {
    /// Tensors converted (cast or quantized).
    converted_tensors: usize,
    /// The reshard without conversion (every tensor as trained).
    unconverted_reshard_s: Option<f64>,
    unconverted_bytes_total: u64,
    /// Bytes the conversion keeps off the links (`unconverted_bytes_total - bytes_total`).
    bytes_saved: i64,
    /// `reshard_s / unconverted_reshard_s`.
    time_ratio: Option<f64>,
    /// The largest conversion workspace of a rank.
    work_bytes_max: u64,
    /// Of the bytes senders convert, the share their first rounds read: converted before
    /// anything is sent, on every sender's critical path (the rest is converted beside the
    /// rounds before; docs/quantization.md, "Conversions beside transfers").
    first_round_share: Option<f64>,
    /// The same share on the sender for which it is largest…
    first_round_share_max: Option<f64>,
    /// …and that sender (the lowest such rank).
    first_round_share_rank: Option<u32>,
}

impl ConversionJson {
    pub fn new(s: &Simulation, conversions: &[Option<Conversion>]) -> Option<ConversionJson> {
        let plain = s.unconverted.as_ref()?;
        let senders = converted_first(&s.programs);
        // The sender whose first round reads the largest share (the first such, by rank).
        let busiest = senders
            .iter()
            .filter_map(|&(rank, all, first)| ratio(first as f64, all as f64).map(|r| (rank, r)))
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        Some(ConversionJson {
            converted_tensors: conversions.iter().flatten().count(),
            unconverted_reshard_s: finite(plain.time_s),
            unconverted_bytes_total: plain.bytes_total,
            bytes_saved: plain.bytes_total as i64 - s.reshard.bytes_total as i64,
            time_ratio: ratio(s.reshard.time_s, plain.time_s),
            work_bytes_max: s.programs.iter().map(|p| p.work_bytes).max().unwrap_or(0),
            first_round_share: ratio(
                senders.iter().map(|s| s.2 as f64).sum(),
                senders.iter().map(|s| s.1 as f64).sum(),
            ),
            first_round_share_max: busiest.map(|(_, share)| share),
            first_round_share_rank: busiest.map(|(rank, _)| rank),
        })
    }
}

/// The most ranks passing one senders' barrier together: a member and its mates (0 when no
/// program has a barrier).
pub fn barrier_members_max(programs: &[RankProgram]) -> usize {
    programs
        .iter()
        .filter(|p| p.has_barrier())
        .map(|p| p.barrier_members.len())
        .max()
        .unwrap_or(0)
}

/// Per sender: its rank, the bytes it converts before the rounds, and of them those its
/// first round reads.
fn converted_first(programs: &[RankProgram]) -> Vec<(u32, u64, u64)> {
    let bytes = |c: &[StridedConvert]| -> u64 { c.iter().map(StridedConvert::src_bytes).sum() };
    programs
        .iter()
        .filter(|p| !p.converts_before.is_empty())
        .map(|p| {
            let first = p.rounds_iter().next().map_or(0, |r| bytes(r.converts));
            (p.rank, bytes(&p.converts_before), first)
        })
        .collect()
}

pub fn link_json(link: &LinkUse) -> (&'static str, &'static str) {
    link_names(link.kind, link.direction)
}

fn link_names(kind: LinkKind, direction: Direction) -> (&'static str, &'static str) {
    let kind = match kind {
        LinkKind::NvLink => "nvlink",
        LinkKind::Nic => "nic",
    };
    let direction = match direction {
        Direction::Egress => "egress",
        Direction::Ingress => "ingress",
    };
    (kind, direction)
}

/// [`sim::RoundsProfile`] as `simulate --json` prints it (docs/simulator.md §7, "Rounds").
#[derive(Serialize)]
struct RoundsJson {
    /// The most seconds any GPU link needs for all its bytes at achievable speed.
    busiest_total_s: f64,
    /// Each round's busiest link's seconds, summed: the transfers' time if all ranks moved
    /// from round to round together.
    lockstep_s: f64,
    /// `lockstep_s − busiest_total_s`: what uneven rounds cost ranks that move in lockstep.
    unevenness_s: f64,
    /// Per round: the link whose bytes of that round take longest at achievable speed.
    rounds: Vec<RoundJson>,
}

#[derive(Serialize)]
struct RoundJson {
    round: u32,
    rank: u32,
    /// "nvlink" or "nic".
    kind: &'static str,
    /// "egress" or "ingress".
    direction: &'static str,
    bytes: u64,
    seconds: f64,
}

impl RoundsJson {
    fn new(profile: &sim::RoundsProfile) -> RoundsJson {
        RoundsJson {
            busiest_total_s: profile.busiest_total_s,
            lockstep_s: profile.lockstep_s(),
            unevenness_s: profile.unevenness_s(),
            rounds: profile
                .rounds
                .iter()
                .map(|r| {
                    let (kind, direction) = link_names(r.kind, r.direction);
                    RoundJson {
                        round: r.round,
                        rank: r.rank,
                        kind,
                        direction,
                        bytes: r.bytes,
                        seconds: r.seconds,
                    }
                })
                .collect(),
        }
    }
}

fn bound_kind(kind: BoundKind) -> &'static str {
    match kind {
        BoundKind::DomainIngress => "domain_ingress",
        BoundKind::DomainEgress => "domain_egress",
        BoundKind::GpuIngress => "gpu_ingress",
        BoundKind::GpuEgress => "gpu_egress",
        BoundKind::DirectEgress => "direct_egress",
    }
}

fn phases(report: &SimReport) -> BTreeMap<&'static str, f64> {
    report.phases.iter().map(|p| (p.name, p.seconds)).collect()
}

/// `Some(t)` for a finite time (a simulated call), `None` for one that was not simulated.
pub fn finite(t: f64) -> Option<f64> {
    t.is_finite().then_some(t)
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite() && b.is_finite()).then(|| a / b)
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let args = RefitArgs::parse(parsed, "simulate")?;
    let cluster = refit_setup::cluster(parsed, "simulate")?;
    let mode = refit_setup::mode(parsed, "simulate")?;
    let mut options = sim_options(parsed, "simulate")?;
    options.rank = parsed
        .number::<u32>("rank")
        .map_err(|e| usage("simulate", e))?;
    let views = Views::parse(parsed, "simulate")?;
    let started = Instant::now();
    let refit = args.refit(1)?;
    let build_s = started.elapsed().as_secs_f64();
    if refit.tensors.is_empty() {
        return Err(usage("simulate", "the model has no tensors"));
    }
    let ranks = refit.world();
    if let Some(rank) = options.rank.filter(|&r| r >= ranks) {
        return Err(usage(
            "simulate",
            format!(
                "--rank {rank} is not a rank of this refit: its ranks are 0 to {}",
                ranks - 1
            ),
        ));
    }
    let mut config = refit_setup::config_with_options(parsed, "simulate", mode, &cluster)?;
    config.sender_barrier = refit_setup::sender_barrier(parsed, "simulate")?;
    let sender_barrier = refit_setup::sender_barrier_name(config.sender_barrier);
    let conversions = args.conversions(&refit, 1)?;
    let s = simulate(&refit, &conversions, &cluster, config, &options, views)?;
    let memory = s.reshard.memory;
    let reshard = finite(s.reshard.time_s);
    let output = Output {
        model: args.model.name().to_string(),
        train: args.train_text.clone(),
        infer: args.infer_text.clone(),
        train_ranks: [refit.train_ranks.start, refit.train_ranks.end],
        infer_ranks: [refit.infer_ranks.start, refit.infer_ranks.end],
        ranks: s.programs.len(),
        colocated: args.options.colocated,
        dtype: args.options.dtype.to_string(),
        infer_dtype: args.infer_dtype_name(),
        experts: args.experts_name(),
        views: views.name(),
        mode: mode.name(),
        sender_barrier,
        barrier_members_max: barrier_members_max(&s.programs),
        cluster: ClusterJson::new(&cluster, s.programs.len()),
        tensors: refit.tensors.len(),
        parameters: args.parameters(),
        model_bytes: refit.bytes(),
        fits: s.reshard.fits(),
        reshard_s: reshard,
        reshard_p90_s: finite(s.reshard.p90_s),
        trials: s.reshard.trials,
        setup_s: s.reshard.setup_s,
        m2n_hierarchical_s: s.m2n_hierarchical.complete_time(),
        m2n_direct_s: s.m2n_direct.complete_time(),
        m2n_hierarchical_one_comm_s: s.m2n_one_comm.complete_time(),
        gather_broadcast_s: s.baseline.time_s,
        lower_bound_s: s.bound.time_s,
        direct_bound_s: s.bound.direct_time_s,
        reshard_over_lower_bound: ratio(s.reshard.time_s, s.bound.time_s),
        m2n_hierarchical_over_reshard: ratio(complete(&s.m2n_hierarchical), s.reshard.time_s),
        gather_broadcast_over_reshard: ratio(s.baseline.time_s, s.reshard.time_s),
        with_engine_postprocess: WithPostprocessJson::new(&s),
        bytes_total: s.reshard.bytes_total,
        bytes_offnode: s.reshard.bytes_offnode,
        bytes_local: s.reshard.bytes_local,
        messages_total: s.reshard.messages_total,
        messages_max_per_rank: s.reshard.messages_max_per_rank,
        messages_mean_per_rank: s.reshard.messages_mean_per_rank,
        bytes_max_per_rank: s.reshard.bytes_max_per_rank,
        staged_ranks: s.programs.iter().filter(|p| !p.unpacks.is_empty()).count(),
        staging_bytes_max: s
            .programs
            .iter()
            .map(|p| p.staging_bytes)
            .max()
            .unwrap_or(0),
        peak_staging_bytes: s
            .programs
            .iter()
            .map(|p| p.staging_bytes)
            .max()
            .unwrap_or(0),
        memory: memory.map(|m| MemoryJson {
            rank: m.rank,
            staging_bytes: m.staging_bytes,
            nccl_buffer_bytes: m.nccl_bytes,
            work_bytes: m.work_bytes,
            free_bytes: m.free_bytes,
            fits: m.fits(),
        }),
        busiest_link: s.reshard.busiest_link.as_ref().map(|l| {
            let (kind, direction) = link_json(l);
            LinkJson {
                rank: l.rank,
                kind,
                direction,
                bytes: l.bytes,
                busy_fraction: l.busy_fraction,
            }
        }),
        nic_bytes: [("train", &refit.train_ranks), ("infer", &refit.infer_ranks)]
            .into_iter()
            .map(|(side, ranks)| (side, SideNicJson::new(&s.reshard.nic_bytes, ranks.clone())))
            .collect(),
        critical_path: s
            .reshard
            .critical
            .as_ref()
            .map(|c| CriticalJson::new(c, &s)),
        rounds_profile: s.reshard.rounds.as_ref().map(RoundsJson::new),
        reshard_phases: phases(&s.reshard),
        m2n_hierarchical: M2nJson::new(&s.m2n_hierarchical),
        m2n_direct: M2nJson::new(&s.m2n_direct),
        m2n_hierarchical_one_comm: M2nJson::new(&s.m2n_one_comm),
        gather_broadcast: BaselineJson {
            time_s: s.baseline.time_s,
            bytes_total: s.baseline.bytes_total,
            bytes_offnode: s.baseline.bytes_offnode,
            messages_total: s.baseline.messages_total,
            messages_max_per_rank: s.baseline.messages_max_per_rank,
            phases: phases(&s.baseline),
        },
        lower_bound_binding: s.bound.binding.to_string(),
        direct_bound_binding: s.bound.direct_binding.to_string(),
        lower_bounds: s
            .bound
            .bounds
            .iter()
            .map(|b| BoundJson {
                kind: bound_kind(b.kind),
                subject: b.subject,
                domains: b.domains.clone(),
                bytes: b.bytes,
                bandwidth_gbs: b.bandwidth / 1e9,
                time_s: b.time_s,
            })
            .collect(),
        conversion: ConversionJson::new(&s, &conversions),
        plan_s: s.plan_s,
        simulate_s: s.simulate_s,
    };
    if parsed.flag("json") {
        out::print(&out::json(&output));
        return Ok(0);
    }
    let mut text = format!(
        "simulate {}: {}\n  {:.1} B parameters in {} tensors, {} per copy ({}, experts {}), mode {}\n  cluster {}\n\n",
        output.model,
        args.specs_text(&refit),
        output.parameters as f64 / 1e9,
        out::count(output.tensors as u64),
        out::bytes(output.model_bytes),
        output.dtype,
        output.experts,
        output.mode,
        cluster_text(&cluster),
    );
    text += &estimates_text(&s);
    if let Some(c) = &output.conversion {
        text += &format!(
            "\n  infer dtype             {} ({} tensors converted on the way)\n  without conversion      {} reshard, {} on links; converting saves {} ({} the time)\n",
            output.infer_dtype,
            out::count(c.converted_tensors as u64),
            c.unconverted_reshard_s.map_or("not run".to_string(), out::seconds),
            out::bytes(c.unconverted_bytes_total),
            out::bytes(c.bytes_saved.max(0) as u64),
            out::ratio(s.reshard.time_s, c.unconverted_reshard_s.unwrap_or(f64::NAN)),
        );
    }
    text += &format!(
        "\n  bytes total             {} ({} off-node, {} local copies)\n  messages                {} total; per rank max {}, mean {:.1}\n  most bytes on a rank    {}\n  staged ranks            {} of {} (staging up to {})\n  busiest link            {}\n  phases (max over ranks) {}\n  planning                {} ({} ranks on {} threads; building the refit {}; simulating {})\n",
        out::bytes(output.bytes_total),
        out::bytes(output.bytes_offnode),
        out::bytes(output.bytes_local),
        out::count(output.messages_total),
        out::count(output.messages_max_per_rank),
        output.messages_mean_per_rank,
        out::bytes(output.bytes_max_per_rank),
        output.staged_ranks,
        output.ranks,
        out::bytes(output.staging_bytes_max),
        s.reshard
            .busiest_link
            .as_ref()
            .map_or("none".to_string(), ToString::to_string),
        s.reshard
            .phases
            .iter()
            .map(|p| format!("{} {}", p.name, out::seconds(p.seconds)))
            .collect::<Vec<_>>()
            .join(", "),
        out::seconds(s.plan_s),
        output.ranks,
        work::threads(),
        out::seconds(build_s),
        out::seconds(s.simulate_s),
    );
    out::print(&text);
    Ok(0)
}

/// `rank 132: 3.82 GB staging + 268.44 MB NCCL buffers of 8.55 GB free`.
fn memory_text(m: &MemoryUse) -> String {
    format!(
        "rank {}: {} staging + {} NCCL buffers + {} conversion workspace of {} free",
        m.rank,
        out::bytes(m.staging_bytes),
        out::bytes(m.nccl_bytes),
        out::bytes(m.work_bytes),
        out::bytes(m.free_bytes)
    )
}

/// A method's name without its parenthesis (`reshard (ncclreshard)` → `reshard`).
fn short_name(name: &str) -> &str {
    name.split(" (").next().unwrap_or(name)
}

/// `dgx-h100 (8 GPUs per node, NVLink domain 8 at 450 GB/s, NIC 50 GB/s per GPU, …)`.
pub fn cluster_text(c: &Cluster) -> String {
    format!(
        "{} ({} GPUs per node, NVLink domain {} at {:.0} GB/s ({:.0} % reached), NIC {:.0} GB/s per GPU ({:.0} %), {}:1 spine, PXN {})",
        c.name,
        c.gpus_per_node,
        c.nvlink_domain,
        c.nvlink_bw / 1e9,
        c.nvlink_efficiency * 100.0,
        c.nic_bw / 1e9,
        c.nic_efficiency * 100.0,
        c.oversubscription,
        if c.pxn { "on" } else { "off" },
    )
}

/// The estimates as aligned lines with their ratios: every method, the floors, the engine
/// post-processing, memory and one-time costs.
pub fn estimates_text(s: &Simulation) -> String {
    let bound = s.bound.time_s;
    let reshard = s.reshard.time_s;
    let row = |name: &str, value: String, note: String| format!("  {name:<24}{value:<12}{note}\n");
    let mut text = String::new();
    match (s.reshard.fits(), s.reshard.memory) {
        (false, Some(m)) => {
            text += &row(
                "reshard (ncclreshard)",
                "not run".to_string(),
                format!("does not fit: {}", memory_text(&m)),
            );
        }
        _ => {
            let spread = if s.reshard.trials > 0 {
                format!(
                    " (median of {} trials, p90 {})",
                    s.reshard.trials,
                    out::seconds(s.reshard.p90_s)
                )
            } else {
                String::new()
            };
            text += &row(
                "reshard (ncclreshard)",
                out::seconds(reshard),
                format!("{} the floor{spread}", out::ratio(reshard, bound)),
            );
        }
    }
    let versus = |t: f64| {
        if reshard.is_finite() {
            format!("{} the reshard", out::ratio(t, reshard))
        } else {
            String::new()
        }
    };
    for (name, m2n) in [
        ("M2N hierarchical", &s.m2n_hierarchical),
        ("M2N direct", &s.m2n_direct),
        ("M2N one communicator", &s.m2n_one_comm),
    ] {
        text += &match (m2n.complete_time(), &m2n.first_skipped) {
            (Some(t), _) => row(name, out::seconds(t), versus(t)),
            (None, why) => row(
                name,
                "cannot".to_string(),
                format!(
                    "M2N cannot move {} of the tensors; first: {}",
                    m2n.skipped.len(),
                    why.as_deref().unwrap_or("-")
                ),
            ),
        };
    }
    text += &row(
        "gather+broadcast",
        out::seconds(s.baseline.time_s),
        versus(s.baseline.time_s),
    );
    text += &row("floor", out::seconds(bound), s.bound.binding.to_string());
    text += &row(
        "direct-plan bound",
        out::seconds(s.bound.direct_time_s),
        s.bound.direct_binding.to_string(),
    );
    let post = ENGINE_POSTPROCESS_S;
    text += &format!(
        "  with engine post-processing ({}, every method): {}\n",
        out::seconds(post),
        s.methods()
            .iter()
            .filter(|(_, t)| t.is_finite())
            .map(|(name, t)| format!("{} {}", short_name(name), out::seconds(t + post)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(m) = s.reshard.memory {
        text += &row("memory (peak rank)", out::bytes(m.total()), memory_text(&m));
    }
    text += &row(
        "setup (once)",
        out::seconds(s.reshard.setup_s),
        "connecting every peer and compiling the copy kernel, not in the times above".to_string(),
    );
    text
}
