//! `ncclreshard simulate`: estimated refit time on a cluster (reshard vs gather+broadcast vs
//! the physical lower bound), from the real programs of every rank.

use super::refit_setup::{self, RefitArgs};
use super::{usage, Command};
use crate::args::{flag, value, Parsed};
use crate::out;
use crate::work;
use crate::Failure;
use ncclreshard::{Config, RankProgram};
use ncclreshard_tools::models::Refit;
use ncclreshard_tools::sim::{
    self, BoundKind, Cluster, Direction, LinkKind, LinkUse, LowerBound, SimReport,
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
        value("experts"),
        flag("colocated"),
        value("mode"),
        value("rounds"),
        flag("no-relay"),
        flag("json"),
    ],
    run,
};

const HELP: &str = r#"Estimate a weight refit on a cluster: reshard vs gather+broadcast vs lower bound

Usage: ncclreshard simulate --model NAME|FILE --train SPEC --infer SPEC [OPTIONS]

Builds the refit's tensors (training layout → inference layout), plans every rank's program
with the same planner users run, and runs them through the cluster model (docs/simulator.md);
also the gather+broadcast baseline (NeMo RL's bucketed broadcast) and the physical lower bound.
Planning hundreds of ranks takes a while; progress goes to stderr, results to stdout.

Options:
  --model NAME|FILE  deepseek-v3, qwen3-235b-a22b, qwen3-32b, llama-3.1-70b, dsv3-toy, a
                     HuggingFace config.json or an M2N *.model.json tensor listing (required)
  --train SPEC       Megatron-style training parallelism: tp,cp,pp,dp,ep,etp (and fsdp), e.g.
                     pp16,ep16 (dp defaults to the smallest that fits ep) (required)
  --infer SPEC       vLLM-style inference parallelism: tp,dp[,ep], e.g. tp32,dp8 (required)
  --system FILE      An NCCL M2N system_configs/*.json instead of --train and --infer
  --cluster C        dgx-h100 (default), gb200-nvl72, or key=value pairs on top of a preset:
                     dgx-h100,nic_gbits=200,latency_us=5 (keys: gpus_per_node, nvlink_domain,
                     nvlink_gbs, nic_gbs, nic_gbits, latency_us, hbm_copy_gbs, peer_fraction,
                     gpu_memory_gb)
  --dtype NAME       Element type of the weights, torch's name (default bfloat16)
  --experts E        stacked (default) or per-expert routed expert tensors
  --colocated        Inference runs on the training ranks (default: the ranks after them)
  --mode MODE        auto (default), staged or groupable
  --rounds N         Staged/auto: rounds to spread the data over (default 0: automatic)
  --no-relay         Send each replica its data across the network (no NVLink relays)
  --json             JSON output: reshard_s, gather_broadcast_s, lower_bound_s, bytes_total,
                     messages_max_per_rank, messages_mean_per_rank, busiest_link, ...
  -h, --help         Show this help

The planner is told that ranks sharing an NVLink domain share a node (8 on dgx-h100, 72 on
gb200-nvl72), so it prefers NVLink senders there.

Example:
  ncclreshard simulate --model deepseek-v3 --train pp16,ep16 --infer tp32,dp8 --cluster dgx-h100
"#;

/// The three estimates of one refit, and what planning it took.
pub struct Simulation {
    pub cluster: Cluster,
    pub programs: Vec<RankProgram>,
    pub reshard: SimReport,
    pub baseline: SimReport,
    pub bound: LowerBound,
    pub plan_s: f64,
    pub simulate_s: f64,
}

/// Plans every rank of `refit` with `config` and simulates it on `cluster`, with the baseline
/// and the bound.
pub fn simulate(refit: &Refit, cluster: &Cluster, config: Config) -> Result<Simulation, Failure> {
    let planner = refit_setup::planner(&refit.tensors, config)?;
    let (programs, planned) = refit_setup::plan_all(&planner, "planning ranks")?;
    let ((reshard, baseline, bound), simulated) = work::track("simulating", 0, |_| {
        (
            sim::simulate(&programs, cluster),
            sim::gather_broadcast(&refit.tensors, cluster),
            sim::lower_bound(&refit.tensors, cluster),
        )
    });
    Ok(Simulation {
        cluster: cluster.clone(),
        programs,
        reshard,
        baseline,
        bound,
        plan_s: planned.as_secs_f64(),
        simulate_s: simulated.as_secs_f64(),
    })
}

#[derive(Serialize)]
struct ClusterJson {
    name: String,
    gpus_per_node: u32,
    nvlink_domain: u32,
    nvlink_gbs: f64,
    nic_gbs: f64,
    latency_us: f64,
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
struct Output {
    model: String,
    train: String,
    infer: String,
    train_ranks: [u32; 2],
    infer_ranks: [u32; 2],
    ranks: usize,
    colocated: bool,
    dtype: String,
    experts: &'static str,
    mode: &'static str,
    cluster: ClusterJson,
    tensors: usize,
    parameters: u64,
    model_bytes: u64,
    reshard_s: f64,
    gather_broadcast_s: f64,
    lower_bound_s: f64,
    reshard_over_lower_bound: f64,
    gather_broadcast_over_reshard: f64,
    bytes_total: u64,
    bytes_offnode: u64,
    bytes_local: u64,
    messages_total: u64,
    messages_max_per_rank: u64,
    messages_mean_per_rank: f64,
    bytes_max_per_rank: u64,
    staged_ranks: usize,
    staging_bytes_max: u64,
    busiest_link: Option<LinkJson>,
    reshard_phases: BTreeMap<&'static str, f64>,
    gather_broadcast: BaselineJson,
    lower_bound_binding: String,
    lower_bounds: Vec<BoundJson>,
    plan_s: f64,
    simulate_s: f64,
}

pub fn link_json(link: &LinkUse) -> (&'static str, &'static str) {
    let kind = match link.kind {
        LinkKind::NvLink => "nvlink",
        LinkKind::Nic => "nic",
    };
    let direction = match link.direction {
        Direction::Egress => "egress",
        Direction::Ingress => "ingress",
    };
    (kind, direction)
}

fn bound_kind(kind: BoundKind) -> &'static str {
    match kind {
        BoundKind::DomainIngress => "domain_ingress",
        BoundKind::DomainEgress => "domain_egress",
        BoundKind::GpuIngress => "gpu_ingress",
        BoundKind::GpuEgress => "gpu_egress",
    }
}

fn phases(report: &SimReport) -> BTreeMap<&'static str, f64> {
    report.phases.iter().map(|p| (p.name, p.seconds)).collect()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let args = RefitArgs::parse(parsed, "simulate")?;
    let cluster = refit_setup::cluster(parsed, "simulate")?;
    let mode = refit_setup::mode(parsed, "simulate")?;
    let started = Instant::now();
    let refit = args.refit(1)?;
    let build_s = started.elapsed().as_secs_f64();
    if refit.tensors.is_empty() {
        return Err(usage("simulate", "the model has no tensors"));
    }
    let config = refit_setup::config_with_options(parsed, "simulate", mode, &cluster)?;
    let s = simulate(&refit, &cluster, config)?;
    let output = Output {
        model: args.model.name().to_string(),
        train: args.train_text.clone(),
        infer: args.infer_text.clone(),
        train_ranks: [refit.train_ranks.start, refit.train_ranks.end],
        infer_ranks: [refit.infer_ranks.start, refit.infer_ranks.end],
        ranks: s.programs.len(),
        colocated: args.options.colocated,
        dtype: args.options.dtype.to_string(),
        experts: args.experts_name(),
        mode: mode.name(),
        cluster: ClusterJson {
            name: cluster.name.clone(),
            gpus_per_node: cluster.gpus_per_node,
            nvlink_domain: cluster.nvlink_domain,
            nvlink_gbs: cluster.nvlink_bw / 1e9,
            nic_gbs: cluster.nic_bw / 1e9,
            latency_us: cluster.latency_s * 1e6,
        },
        tensors: refit.tensors.len(),
        parameters: args.parameters(),
        model_bytes: refit.bytes(),
        reshard_s: s.reshard.time_s,
        gather_broadcast_s: s.baseline.time_s,
        lower_bound_s: s.bound.time_s,
        reshard_over_lower_bound: ratio(s.reshard.time_s, s.bound.time_s),
        gather_broadcast_over_reshard: ratio(s.baseline.time_s, s.reshard.time_s),
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
        reshard_phases: phases(&s.reshard),
        gather_broadcast: BaselineJson {
            time_s: s.baseline.time_s,
            bytes_total: s.baseline.bytes_total,
            bytes_offnode: s.baseline.bytes_offnode,
            messages_total: s.baseline.messages_total,
            messages_max_per_rank: s.baseline.messages_max_per_rank,
            phases: phases(&s.baseline),
        },
        lower_bound_binding: s.bound.binding.to_string(),
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
    text += &format!(
        "\n  bytes total             {} ({} off-node, {} local copies)\n  messages                {} total; per rank max {}, mean {:.1}\n  most bytes on a rank    {}\n  staged ranks            {} of {} (staging up to {})\n  busiest link            {}\n  planning                {} ({} ranks on {} threads; building the refit {})\n",
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
        out::seconds(s.plan_s),
        output.ranks,
        work::threads(),
        out::seconds(build_s),
    );
    out::print(&text);
    Ok(0)
}

/// `dgx-h100 (8 GPUs per node, NVLink domain 8 at 450 GB/s, NIC 50 GB/s per GPU)`.
pub fn cluster_text(c: &Cluster) -> String {
    format!(
        "{} ({} GPUs per node, NVLink domain {} at {:.0} GB/s, NIC {:.0} GB/s per GPU)",
        c.name,
        c.gpus_per_node,
        c.nvlink_domain,
        c.nvlink_bw / 1e9,
        c.nic_bw / 1e9
    )
}

/// The three estimates as aligned lines with their ratios.
pub fn estimates_text(s: &Simulation) -> String {
    let (reshard, baseline, bound) = (s.reshard.time_s, s.baseline.time_s, s.bound.time_s);
    format!(
        "  {:<24}{:<10}  {} the lower bound\n  {:<24}{:<10}  {} the reshard time\n  {:<24}{:<10}  {}\n",
        "reshard (ncclreshard)",
        out::seconds(reshard),
        out::ratio(reshard, bound),
        "gather+broadcast",
        out::seconds(baseline),
        out::ratio(baseline, reshard),
        "lower bound",
        out::seconds(bound),
        s.bound.binding,
    )
}
