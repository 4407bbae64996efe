//! `ncclreshard plan`: what each rank's program does and how much crosses between ranks.

use super::{chosen_mode, load_one, per_file, usage, Command};
use crate::args::{flag, value, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard::exec::{rank_program, StagingLimit};
use ncclreshard::plan::ExecMode;
use ncclreshard::transport::nccl::NcclTransport;
use ncclreshard::{Config, Planner, RankProgram, Topology};
use ncclreshard_tools::case::Case;
use serde::Serialize;

pub const COMMAND: Command = Command {
    name: "plan",
    help: HELP,
    options: &[flag("json"), value("rank"), value("mode"), value("case")],
    run,
};

const HELP: &str = r#"Summarise the rank programs of each case and the traffic between ranks

Usage: ncclreshard plan [OPTIONS] FILE

Without --rank: a summary of every rank in the plan (peers, bytes sent / received / copied
locally, messages sent / received, groupable or staged, staging bytes) and the traffic matrix
(bytes and messages from rank i to rank j, non-zero entries only).

Options:
  --rank R     Only rank R's program summary
  --mode MODE  Plan in this mode (groupable, staged, auto) instead of the case's own
               (a case without a mode is planned in auto mode, the default)
  --case NAME  Only the case with this name (or index in the file)
  --json       JSON output (snake_case keys; an array when the file holds an array)
  -h, --help   Show this help
"#;

#[derive(Serialize)]
struct RankSummary {
    rank: u32,
    /// "groupable" or "staged" (`RankProgram::mode`).
    mode: &'static str,
    peers: Vec<u32>,
    bytes_sent: u64,
    bytes_received: u64,
    bytes_copied_locally: u64,
    messages_sent: usize,
    messages_received: usize,
    local_copies: usize,
    packs: usize,
    unpacks: usize,
    staging_bytes: u64,
    fingerprint: String,
}

#[derive(Serialize)]
struct ConfigSummary {
    mode: &'static str,
    topology: String,
    split_min_bytes: u64,
}

#[derive(Serialize)]
struct Traffic {
    from: u32,
    to: u32,
    bytes: u64,
    messages: u64,
}

#[derive(Serialize)]
struct Totals {
    ranks: usize,
    bytes_sent: u64,
    bytes_copied_locally: u64,
    messages: usize,
    staged_ranks: usize,
    max_staging_bytes: u64,
}

#[derive(Serialize)]
struct CasePlan {
    name: String,
    tensors: usize,
    config: ConfigSummary,
    fingerprint: String,
    totals: Totals,
    ranks: Vec<RankSummary>,
    traffic: Vec<Traffic>,
}

#[derive(Serialize)]
struct OneRank {
    name: String,
    config: ConfigSummary,
    #[serde(flatten)]
    summary: RankSummary,
}

fn mode_name(mode: ExecMode) -> &'static str {
    match mode {
        ExecMode::Groupable => "groupable",
        ExecMode::Staged => "staged",
    }
}

fn summary(p: &RankProgram) -> RankSummary {
    RankSummary {
        rank: p.rank,
        mode: mode_name(p.mode()),
        peers: p.peers(),
        bytes_sent: p.bytes_sent(),
        bytes_received: p.bytes_received(),
        bytes_copied_locally: p.bytes_copied_locally(),
        messages_sent: p.sends.len(),
        messages_received: p.recvs.len(),
        local_copies: p.local_copies.len(),
        packs: p.packs.len(),
        unpacks: p.unpacks.len(),
        staging_bytes: p.staging_bytes,
        fingerprint: format!("{:016x}", p.fingerprint),
    }
}

fn config_summary(config: &Config) -> ConfigSummary {
    ConfigSummary {
        mode: config.mode.name(),
        topology: topology_summary(&config.topology),
        split_min_bytes: config.split_min_bytes,
    }
}

fn topology_summary(topology: &Topology) -> String {
    match topology {
        Topology::Unknown => "unknown".to_string(),
        Topology::RanksPerNode(n) => format!("ranks_per_node={n}"),
        Topology::NodeTable(table) => format!("node_of_rank={table:?}"),
        Topology::Survivors { before, failed } => {
            format!(
                "{}, survivors of failed_ranks={failed:?}",
                topology_summary(before)
            )
        }
    }
}

fn planner(case: &Case, config: Config) -> Result<Planner, Failure> {
    Planner::with_conversions(case.specs(), case.conversions(), config)
        .map_err(|e| Failure::Input(format!("case {}: {e}", case.name)))
}

fn programs(case: &Case, planner: &Planner, ranks: &[u32]) -> Result<Vec<RankProgram>, Failure> {
    ranks
        .iter()
        .map(|&r| {
            // As ncclReshardPlanCreate plans it (the staging limit, the NCCL transport's).
            rank_program(planner, r, StagingLimit::new(0), NcclTransport::LIMITS)
                .map_err(|e| Failure::Input(format!("case {}: rank {r}: {e}", case.name)))
        })
        .collect()
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let file = load_one(parsed, "plan")?;
    let rank = parsed.number::<u32>("rank").map_err(|e| usage("plan", e))?;
    let json = parsed.flag("json");
    let mut one_rank = Vec::new();
    let mut plans = Vec::new();
    let mut text = String::new();
    for case in &file.cases {
        let config = Config {
            mode: chosen_mode(parsed, "plan", case)?,
            ..case.config.clone()
        };
        let planner = planner(case, config.clone())?;
        if let Some(rank) = rank {
            let program = programs(case, &planner, &[rank])?.remove(0);
            let s = summary(&program);
            if !json {
                text += &format!("case {} (mode {})\n", case.name, config.mode.name());
                if !planner.ranks().contains(&rank) {
                    text += &format!("  rank {rank} is in no mesh of this plan\n");
                }
                text += &rank_text(&s);
            }
            one_rank.push(OneRank {
                name: case.name.clone(),
                config: config_summary(&config),
                summary: s,
            });
            continue;
        }
        let ranks = planner.ranks();
        let programs = programs(case, &planner, &ranks)?;
        let plan = case_plan(case, &planner, &programs);
        if !json {
            text += &plan_text(&plan);
        }
        plans.push(plan);
    }
    if !json {
        out::print(&text);
    } else if rank.is_some() {
        out::print(&per_file(&file, one_rank));
    } else {
        out::print(&per_file(&file, plans));
    }
    Ok(0)
}

fn case_plan(case: &Case, planner: &Planner, programs: &[RankProgram]) -> CasePlan {
    let traffic = crate::heatmap::traffic(programs);
    let ranks: Vec<RankSummary> = programs.iter().map(summary).collect();
    let totals = Totals {
        ranks: ranks.len(),
        bytes_sent: ranks.iter().map(|r| r.bytes_sent).sum(),
        bytes_copied_locally: ranks.iter().map(|r| r.bytes_copied_locally).sum(),
        messages: ranks.iter().map(|r| r.messages_sent).sum(),
        staged_ranks: ranks.iter().filter(|r| r.mode == "staged").count(),
        max_staging_bytes: ranks.iter().map(|r| r.staging_bytes).max().unwrap_or(0),
    };
    CasePlan {
        name: case.name.clone(),
        tensors: case.tensors.len(),
        config: config_summary(planner.config()),
        fingerprint: format!("{:016x}", planner.fingerprint()),
        totals,
        ranks,
        traffic: traffic
            .into_iter()
            .filter(|(_, (bytes, _))| *bytes > 0)
            .map(|((from, to), (bytes, messages))| Traffic {
                from,
                to,
                bytes,
                messages,
            })
            .collect(),
    }
}

fn rank_text(s: &RankSummary) -> String {
    format!(
        "  rank {}: {}\n  peers {}\n  sent {} bytes in {} messages, received {} bytes in {} messages\n  copied locally {} bytes in {} copies; {} packs, {} unpacks, staging {} bytes\n  fingerprint {}\n",
        s.rank,
        s.mode,
        out::ranks(&s.peers),
        s.bytes_sent,
        s.messages_sent,
        s.bytes_received,
        s.messages_received,
        s.bytes_copied_locally,
        s.local_copies,
        s.packs,
        s.unpacks,
        s.staging_bytes,
        s.fingerprint
    )
}

/// Ranks up to which the traffic is shown as a grid; larger plans list the pairs.
const MAX_GRID_RANKS: usize = 16;

fn plan_text(plan: &CasePlan) -> String {
    let t = &plan.totals;
    let mut text = format!(
        "case {}: {} tensor(s), mode {}, topology {}, fingerprint {}\n  {} ranks, {} bytes sent in {} messages, {} bytes copied locally, {} staged ranks\n",
        plan.name,
        plan.tensors,
        plan.config.mode,
        plan.config.topology,
        plan.fingerprint,
        t.ranks,
        t.bytes_sent,
        t.messages,
        t.bytes_copied_locally,
        t.staged_ranks
    );
    text += &format!(
        "  {:>6}  {:<9}  {:>5}  {:>12}  {:>12}  {:>12}  {:>8}  {:>8}  {:>10}\n",
        "rank", "mode", "peers", "sent", "received", "local", "msgs out", "msgs in", "staging"
    );
    for r in &plan.ranks {
        text += &format!(
            "  {:>6}  {:<9}  {:>5}  {:>12}  {:>12}  {:>12}  {:>8}  {:>8}  {:>10}\n",
            r.rank,
            r.mode,
            r.peers.len(),
            r.bytes_sent,
            r.bytes_received,
            r.bytes_copied_locally,
            r.messages_sent,
            r.messages_received,
            r.staging_bytes
        );
    }
    if plan.traffic.is_empty() {
        text += "  no traffic between ranks\n";
    } else if plan.ranks.len() <= MAX_GRID_RANKS {
        text += "  traffic in bytes (row sends to column):\n";
        let ranks: Vec<u32> = plan.ranks.iter().map(|r| r.rank).collect();
        let cell = |from: u32, to: u32| {
            plan.traffic
                .iter()
                .find(|e| e.from == from && e.to == to)
                .map_or_else(|| ".".to_string(), |e| e.bytes.to_string())
        };
        let width = plan
            .traffic
            .iter()
            .map(|e| e.bytes.to_string().len())
            .max()
            .unwrap_or(1)
            .max(4);
        text += &format!("  {:>6}", "");
        for &to in &ranks {
            text += &format!("  {to:>width$}");
        }
        text += "\n";
        for &from in &ranks {
            text += &format!("  {from:>6}");
            for &to in &ranks {
                text += &format!("  {:>width$}", cell(from, to));
            }
            text += "\n";
        }
    } else {
        text += "  traffic:\n";
        for e in &plan.traffic {
            text += &format!(
                "    {} -> {}: {} bytes in {} messages\n",
                e.from, e.to, e.bytes, e.messages
            );
        }
    }
    text
}
