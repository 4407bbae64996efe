//! `ncclreshard bench`: measured on this machine, each comparison in one run — planning a model
//! refit (`--plan`), the host executor's reshard vs a host gather+broadcast (`--exec`), and
//! the host copy routine vs `memcpy` (`--copy`).

use super::refit_setup::{self, RefitArgs};
use super::{usage, Command};
use crate::args::{flag, value, Parsed};
use crate::host_run;
use crate::out;
use crate::work;
use crate::Failure;
use ncclreshard::exec::{rank_program, StagingLimit};
use ncclreshard::plan::{Buffer, CopyDim, Loc, StridedCopy};
use ncclreshard::transport::host::copy_block;
use ncclreshard::transport::nccl::NcclTransport;
use serde::Serialize;
use std::hint::black_box;
use std::time::{Duration, Instant};

pub const COMMAND: Command = Command {
    name: "bench",
    help: HELP,
    options: &[
        flag("plan"),
        flag("exec"),
        flag("copy"),
        value("model"),
        value("train"),
        value("infer"),
        value("system"),
        value("scale"),
        value("cluster"),
        value("dtype"),
        value("infer-dtype"),
        value("experts"),
        flag("colocated"),
        value("mode"),
        value("rounds"),
        flag("no-relay"),
        value("failed"),
        value("sample"),
        value("rank"),
        flag("digest"),
        value("mib"),
        value("row"),
        value("pad"),
        value("repeat"),
        flag("json"),
    ],
    run,
};

/// `--plan` plans this many of the slowest ranks again one at a time, best of
/// [`ALONE_REPEAT`].
const ALONE_RANKS: usize = 8;
const ALONE_REPEAT: usize = 3;

/// `--exec` divides widths by this unless `--scale` says otherwise (as `refit` does).
const DEFAULT_EXEC_SCALE: u64 = 32;

const HELP: &str = r#"Measure planning, host execution and host copies on this machine

Usage: ncclreshard bench --plan --model M --train SPEC --infer SPEC [OPTIONS]
       ncclreshard bench --exec --model M --train SPEC --infer SPEC [--scale N] [OPTIONS]
       ncclreshard bench --copy [--mib N] [--row BYTES] [--pad BYTES]

--plan   Planner time of a full-size model refit: Planner::new + rank_program (a rank's
         program as plan creation makes it) for one rank (the first training rank; also the
         first inference rank), for every rank (wall time on all CPUs, and the CPU time
         summed over ranks), the slowest rank (and the 8 slowest planned again one at a
         time, best of --repeat (3): ranks planned side by side wait for each other and for other
         processes), and the peak resident memory (VmHWM) of planning every rank's program
         on all CPUs, keeping none.
         JSON keys: plan_ms_one_rank, plan_ms_all_ranks, plan_ms_slowest_rank,
         plan_ms_slowest_rank_alone, messages_max_per_rank, peak_rss_mb, ...
--exec   On the refit with widths divided by --scale (default 32): the host executor's
         reshard (every rank a thread) vs gather+broadcast emulated on the host (the first
         source rank assembles each tensor from one copy of every shard, then every
         destination rank receives the whole tensor and slices its view out), same buffers,
         both results compared byte for byte. Times, bytes moved between ranks, ratios.
--copy   Host pack/unpack throughput: the executor's block copy (transport::host::copy_block) on
         --mib MiB in --row-byte rows with a --pad-byte gap between source rows (pack), the
         reverse (unpack) and one contiguous block, vs copy_from_slice of the same bytes.
         Best of --repeat runs (default 5); GB/s = bytes copied per second.

Options:
  --model, --train, --infer, --system, --dtype, --experts, --colocated, --mode, --rounds,
  --no-relay, --cluster
               As for `ncclreshard simulate` (the cluster sets the planner's topology)
  --infer-dtype D  --plan: plan the refit that converts on the way (as `simulate
               --infer-dtype`; docs/quantization.md), e.g. fp8-block128
  --sample N   --plan: plan only N ranks spread evenly over the refit (the first training and
               inference ranks among them) instead of every rank, for refits of thousands
               of ranks; the all-ranks, slowest and peak-memory figures are then over those
  --rank R,..  --plan: also plan these ranks alone, best of --repeat (default 3) each: time,
               messages (JSON ranks_alone), e.g. a refit's first, last and slowest ranks
  --digest     --plan: also a hash of the planned ranks' programs (programs_digest), equal
               iff the planner planned the same programs
  --failed R,..  --plan: the survivors' plan after these ranks failed (docs/resilience.md):
               layouts renumbered as ncclCommShrink renumbers, sources from surviving
               replicas; the renumbering is timed too (plan_ms_survivors)
  --scale N    Width divisor for --exec (default 32)
  --mib N      Bytes of --copy in MiB (default 256)
  --row BYTES  Row size of --copy (default 4096)
  --pad BYTES  Gap between strided rows of --copy (default 64)
  --repeat N   Runs of each --copy variant (default 5); --plan: of each rank planned alone,
               the slowest and --rank's (default 3)
  --json       JSON output (snake_case keys)
  -h, --help   Show this help

Exit status: 0 success; 1 when --exec's two runs leave different bytes or the host executor
fails; 2 usage or input error.

Example:
  ncclreshard bench --plan --model deepseek-v3 --train pp16,ep16 --infer tp32,dp8 --json
"#;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let chosen: Vec<&str> = ["plan", "exec", "copy"]
        .into_iter()
        .filter(|m| parsed.flag(m))
        .collect();
    for option in ["failed", "infer-dtype"] {
        if parsed.value(option).is_some() && chosen.as_slice() != ["plan"] {
            return Err(usage("bench", format!("--{option} is an option of --plan")));
        }
    }
    match chosen.as_slice() {
        ["plan"] => bench_plan(parsed),
        ["exec"] => bench_exec(parsed),
        ["copy"] => bench_copy(parsed),
        [] => Err(usage(
            "bench",
            "choose what to measure: --plan, --exec or --copy",
        )),
        _ => Err(usage(
            "bench",
            format!(
                "--{} measure different things; give one per run",
                chosen.join(" and --")
            ),
        )),
    }
}

#[derive(Serialize)]
struct PlanBench {
    model: String,
    train: String,
    infer: String,
    tensors: usize,
    /// What inference stores (`--infer-dtype`, else the training dtype), and how many
    /// tensors are converted on the way.
    infer_dtype: String,
    converted_tensors: usize,
    ranks: usize,
    /// With `--sample N`: the ranks planned (N spread evenly, the first training and
    /// inference ranks among them); the all-ranks figures are then over these.
    sampled_ranks: Option<usize>,
    mode: &'static str,
    threads: usize,
    /// `--failed`: the failed ranks, and the time to renumber the layouts for the survivors
    /// (part of `plan_ms_new`, which is then the survivors' planner).
    failed_ranks: Vec<u32>,
    plan_ms_survivors: f64,
    plan_ms_new: f64,
    /// `Planner::new` + `rank_program(one_rank)`.
    plan_ms_one_rank: f64,
    one_rank: u32,
    plan_ms_first_infer_rank: f64,
    first_infer_rank: u32,
    /// `Planner::new` + every rank's program, wall time on `threads` threads.
    plan_ms_all_ranks: f64,
    /// `Planner::new` + the sum of every rank's `rank_program` time (one CPU).
    plan_ms_all_ranks_cpu: f64,
    plan_ms_slowest_rank: f64,
    slowest_rank: u32,
    /// The slowest ranks of the run on all CPUs planned again one at a time (best of
    /// `--repeat`, default [`ALONE_REPEAT`], each): `Planner::new` + the largest of their times, and its rank.
    /// Ranks planned side by side share this machine's caches and cores, so the slowest of
    /// thousands is mostly the one that waited longest.
    plan_ms_slowest_rank_alone: f64,
    slowest_rank_alone: u32,
    messages_total: u64,
    messages_max_per_rank: u64,
    /// The rank that posts them.
    messages_max_rank: u32,
    bytes_total: u64,
    peak_rss_mb: Option<f64>,
    /// `--digest`: a hash of the planned ranks' programs (equal iff the planner planned the
    /// same programs).
    programs_digest: Option<String>,
    /// `--rank`: each rank asked for, planned alone.
    ranks_alone: Vec<RankAlone>,
}

/// A rank `--rank` asked for: `Planner::new` + its `rank_program` alone, best of `--repeat`.
#[derive(Serialize)]
struct RankAlone {
    rank: u32,
    plan_ms: f64,
    messages: u64,
}

/// `n` of `ranks` (sorted) spread evenly from the first to the last, with `keep` among them.
fn spread(ranks: &[u32], n: usize, keep: &[u32]) -> Vec<u32> {
    let mut picked: Vec<u32> = if n >= ranks.len() || ranks.len() < 2 {
        ranks.to_vec()
    } else {
        let last = ranks.len() - 1;
        (0..n.max(2))
            .map(|i| ranks[i * last / (n.max(2) - 1)])
            .collect()
    };
    picked.extend(keep.iter().filter(|r| ranks.binary_search(r).is_ok()));
    picked.sort_unstable();
    picked.dedup();
    picked
}

fn bench_plan(parsed: &Parsed) -> Result<u8, Failure> {
    let args = RefitArgs::parse(parsed, "bench")?;
    let sample: Option<usize> = parsed
        .number::<usize>("sample")
        .map_err(|e| usage("bench", e))?
        .filter(|&n| n > 0);
    let cluster = refit_setup::cluster(parsed, "bench")?;
    let mode = refit_setup::mode(parsed, "bench")?;
    let refit = args.refit(1)?;
    let config = refit_setup::config_with_options(parsed, "bench", mode, &cluster)?;

    let failed: Vec<u32> = match parsed.numbers("failed").map_err(|e| usage("bench", e))? {
        None => Vec::new(),
        Some(ranks) => {
            let mut ranks = ranks
                .into_iter()
                .map(|r| {
                    u32::try_from(r).map_err(|_| usage("bench", format!("--failed: rank {r}")))
                })
                .collect::<Result<Vec<u32>, Failure>>()?;
            ranks.sort_unstable();
            ranks.dedup();
            ranks
        }
    };
    // With --infer-dtype: the conversions the refit makes on the way.
    let converting = args.conversions(&refit, 1)?;
    // With --failed: the survivors' plan (renumbered as ncclCommShrink renumbers), timed too.
    let (survived, survivors) = if failed.is_empty() {
        (None, Duration::ZERO)
    } else {
        let started = Instant::now();
        let survived = ncclreshard::plan::survivors(&refit.tensors, &converting, &config, &failed)
            .map_err(|e| Failure::Input(format!("--failed: {e}")))?;
        (Some(survived), started.elapsed())
    };
    let (tensors, conversions, config) = match &survived {
        Some((tensors, conversions, config)) => (&tensors[..], &conversions[..], config.clone()),
        None => (&refit.tensors[..], &converting[..], config),
    };
    let started = Instant::now();
    let planner = refit_setup::planner(tensors, conversions, config)?;
    let new = survivors + started.elapsed();
    // A rank of the refit among the survivors (the next survivor when it is one of the failed).
    let survivor = |rank: u32| -> u32 {
        let mut rank = rank;
        while failed.contains(&rank) {
            rank += 1;
        }
        rank - failed.iter().filter(|&&f| f < rank).count() as u32
    };
    let one = |rank: u32| -> Result<Duration, Failure> {
        let started = Instant::now();
        rank_program(&planner, rank, StagingLimit::new(0), NcclTransport::LIMITS)
            .map_err(|e| Failure::Input(format!("rank {rank}: {e}")))?;
        Ok(started.elapsed())
    };
    let (one_rank, first_infer) = (
        survivor(refit.train_ranks.start),
        survivor(refit.infer_ranks.start),
    );
    // rank_program keeps no cache between calls: each is a cold start.
    let one_rank_time = one(one_rank)?;
    let first_infer_time = one(first_infer)?;

    // Every rank (or --sample of them), keeping only a summary of each program so the peak
    // memory is the planner's.
    let mut ranks = planner.ranks();
    if let Some(n) = sample {
        ranks = spread(&ranks, n, &[one_rank, first_infer]);
    }
    let (summaries, all) = work::track("planning ranks", ranks.len(), |done| {
        work::map(&ranks, done, |&rank| {
            let started = Instant::now();
            let program = rank_program(&planner, rank, StagingLimit::new(0), NcclTransport::LIMITS);
            let took = started.elapsed();
            program.map(|p| {
                (
                    rank,
                    took,
                    p.sends.len() as u64,
                    (p.sends.len() + p.recvs.len()) as u64,
                    p.bytes_sent(),
                )
            })
        })
    });
    let summaries = summaries
        .into_iter()
        .collect::<ncclreshard::Result<Vec<_>>>()
        .map_err(|e| Failure::Input(e.to_string()))?;
    let cpu: Duration = summaries.iter().map(|s| s.1).sum();
    let slowest = summaries
        .iter()
        .max_by_key(|s| s.1)
        .map_or((0, Duration::ZERO), |s| (s.0, s.1));
    let mut by_time: Vec<(Duration, u32)> = summaries.iter().map(|s| (s.1, s.0)).collect();
    by_time.sort_unstable_by(|a, b| b.cmp(a));
    // --digest: what the planned ranks' programs are, to tell a faster planner from a different
    // one (a refactor must leave every program as it was).
    let digest = if parsed.flag("digest") {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for &rank in &ranks {
            let program = rank_program(&planner, rank, StagingLimit::new(0), NcclTransport::LIMITS)
                .map_err(|e| Failure::Input(format!("rank {rank}: {e}")))?;
            std::hash::Hash::hash(&format!("{program:?}"), &mut h);
        }
        Some(format!("{:016x}", std::hash::Hasher::finish(&h)))
    } else {
        None
    };
    // --repeat: runs of each rank planned alone (the slowest and --rank's), best taken.
    let repeat = parsed
        .number::<usize>("repeat")
        .map_err(|e| usage("bench", e))?
        .unwrap_or(ALONE_REPEAT)
        .max(1);
    let mut slowest_alone = (0, Duration::ZERO);
    for &(_, rank) in by_time.iter().take(ALONE_RANKS) {
        let mut best = Duration::MAX;
        for _ in 0..repeat {
            best = best.min(one(rank)?);
        }
        if best > slowest_alone.1 {
            slowest_alone = (rank, best);
        }
    }
    // --rank: the ranks asked for, each alone, best of --repeat.
    let asked: Vec<u64> = parsed
        .numbers("rank")
        .map_err(|e| usage("bench", e))?
        .unwrap_or_default();
    let mut ranks_alone = Vec::with_capacity(asked.len());
    for rank in asked {
        let rank = u32::try_from(rank)
            .ok()
            .filter(|r| planner.ranks().binary_search(r).is_ok())
            .ok_or_else(|| {
                usage(
                    "bench",
                    format!("--rank: {rank} is not a rank of the refit"),
                )
            })?;
        let mut best = Duration::MAX;
        for _ in 0..repeat {
            best = best.min(one(rank)?);
        }
        let program = rank_program(&planner, rank, StagingLimit::new(0), NcclTransport::LIMITS)
            .map_err(|e| Failure::Input(format!("rank {rank}: {e}")))?;
        ranks_alone.push(RankAlone {
            rank,
            plan_ms: ms(new + best),
            messages: (program.sends.len() + program.recvs.len()) as u64,
        });
    }
    let result = PlanBench {
        model: args.model.name().to_string(),
        train: args.train_text.clone(),
        infer: args.infer_text.clone(),
        tensors: refit.tensors.len(),
        infer_dtype: args.infer_dtype_name(),
        converted_tensors: converting.iter().flatten().count(),
        ranks: planner.ranks().len(),
        sampled_ranks: sample.map(|_| ranks.len()),
        mode: mode.name(),
        threads: work::threads(),
        failed_ranks: failed.clone(),
        plan_ms_survivors: ms(survivors),
        plan_ms_new: ms(new),
        plan_ms_one_rank: ms(new + one_rank_time),
        one_rank,
        plan_ms_first_infer_rank: ms(new + first_infer_time),
        first_infer_rank: first_infer,
        plan_ms_all_ranks: ms(new + all),
        plan_ms_all_ranks_cpu: ms(new + cpu),
        plan_ms_slowest_rank: ms(new + slowest.1),
        slowest_rank: slowest.0,
        plan_ms_slowest_rank_alone: ms(new + slowest_alone.1),
        slowest_rank_alone: slowest_alone.0,
        messages_total: summaries.iter().map(|s| s.2).sum(),
        messages_max_per_rank: summaries.iter().map(|s| s.3).max().unwrap_or(0),
        messages_max_rank: summaries.iter().max_by_key(|s| s.3).map_or(0, |s| s.0),
        bytes_total: summaries.iter().map(|s| s.4).sum(),
        peak_rss_mb: work::peak_rss_mb(),
        programs_digest: digest,
        ranks_alone,
    };
    if parsed.flag("json") {
        out::print(&out::json(&result));
        return Ok(0);
    }
    let r = &result;
    let converted_line = if r.converted_tensors == 0 {
        String::new()
    } else {
        format!(
            " ({} converted to {} on the way)",
            out::count(r.converted_tensors as u64),
            r.infer_dtype
        )
    };
    let survivors_line = if failed.is_empty() {
        String::new()
    } else {
        format!(
            "  survivors' plan: ranks {} failed; renumbering {:.2} ms (included below)\n",
            out::ranks(&failed),
            r.plan_ms_survivors
        )
    };
    out::print(&format!(
        "bench --plan {}: {}\n  {} tensors{converted_line}, {} ranks, mode {}, topology {} ranks per node\n{survivors_line}  Planner::new                    {:>10.2} ms\n  one rank (rank {:<5})           {:>10.2} ms   Planner::new + rank_program\n  first inference rank ({:<5})   {:>10.2} ms\n  slowest rank ({:<5})           {:>10.2} ms\n  slowest rank alone ({:<5})     {:>10.2} ms   the {} slowest, again one at a time\n  all ranks, wall                 {:>10.2} ms   on {} threads\n  all ranks, CPU                  {:>10.2} ms   sum over ranks\n  messages                        {} (at most {} per rank)\n  bytes sent                      {}\n  peak resident memory            {}\n",
        r.model,
        args.specs_text(&refit),
        out::count(r.tensors as u64),
        r.ranks,
        r.mode,
        cluster.nvlink_domain,
        r.plan_ms_new,
        r.one_rank,
        r.plan_ms_one_rank,
        r.first_infer_rank,
        r.plan_ms_first_infer_rank,
        r.slowest_rank,
        r.plan_ms_slowest_rank,
        r.slowest_rank_alone,
        r.plan_ms_slowest_rank_alone,
        ALONE_RANKS,
        r.plan_ms_all_ranks,
        r.threads,
        r.plan_ms_all_ranks_cpu,
        out::count(r.messages_total),
        r.messages_max_per_rank,
        out::bytes(r.bytes_total),
        r.peak_rss_mb
            .map_or("unknown".to_string(), |mb| format!("{mb:.0} MiB")),
    ));
    for alone in &r.ranks_alone {
        out::print(&format!(
            "  rank {:<5} alone               {:>10.2} ms   {} messages\n",
            alone.rank, alone.plan_ms, alone.messages
        ));
    }
    Ok(0)
}

#[derive(Serialize)]
struct ExecBench {
    model: String,
    scale: u64,
    tensors: usize,
    ranks: usize,
    mode: &'static str,
    threads: usize,
    reshard_s: f64,
    gather_broadcast_s: f64,
    gather_broadcast_over_reshard_time: f64,
    reshard_bytes: u64,
    reshard_bytes_local: u64,
    reshard_messages: u64,
    gather_broadcast_bytes: u64,
    gather_bytes: u64,
    broadcast_bytes: u64,
    gather_broadcast_over_reshard_bytes: f64,
    results_match: bool,
    plan_s: f64,
    fill_s: f64,
    peak_rss_mb: Option<f64>,
}

fn bench_exec(parsed: &Parsed) -> Result<u8, Failure> {
    let args = RefitArgs::parse(parsed, "bench")?;
    let scale = refit_setup::scale(parsed, "bench", DEFAULT_EXEC_SCALE)?;
    let cluster = refit_setup::cluster(parsed, "bench")?;
    let mode = refit_setup::mode(parsed, "bench")?;
    let refit = args.refit(scale)?;
    let tensors = &refit.tensors;
    let Some(run) = host_run::plan_fill_execute(
        tensors,
        &vec![None; tensors.len()],
        refit_setup::config_with_options(parsed, "bench", mode, &cluster)?,
    )?
    else {
        return Ok(1);
    };
    let (ranks, programs, buffers) = (&run.ranks, &run.programs, &run.buffers);
    let mut destinations = host_run::fresh_destinations(tensors, ranks)?;
    let (baseline, baseline_time) =
        host_run::run_baseline(tensors, ranks, buffers, &mut destinations)?;
    let results_match = buffers
        .iter()
        .zip(&destinations)
        .all(|(memory, dst)| memory.dst == *dst);
    let reshard_bytes: u64 = programs.iter().map(|p| p.bytes_sent()).sum();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let r = ExecBench {
        model: format!("{}/{scale}", args.model.name()),
        scale,
        tensors: tensors.len(),
        ranks: ranks.len(),
        mode: mode.name(),
        threads: work::threads(),
        reshard_s: run.execute.as_secs_f64(),
        gather_broadcast_s: baseline_time.as_secs_f64(),
        gather_broadcast_over_reshard_time: ratio(
            baseline_time.as_secs_f64(),
            run.execute.as_secs_f64(),
        ),
        reshard_bytes,
        reshard_bytes_local: programs.iter().map(|p| p.bytes_copied_locally()).sum(),
        reshard_messages: programs.iter().map(|p| p.sends.len() as u64).sum(),
        gather_broadcast_bytes: baseline.total(),
        gather_bytes: baseline.gather,
        broadcast_bytes: baseline.broadcast,
        gather_broadcast_over_reshard_bytes: ratio(baseline.total() as f64, reshard_bytes as f64),
        results_match,
        plan_s: run.plan.as_secs_f64(),
        fill_s: run.fill.as_secs_f64(),
        peak_rss_mb: work::peak_rss_mb(),
    };
    if parsed.flag("json") {
        out::print(&out::json(&r));
    } else {
        out::print(&format!(
            "bench --exec {}: {}\n  {} tensors, {} ranks, mode {}, {} CPU threads\n                      time          bytes between ranks\n  reshard          {:>10}   {:>12} in {} messages (+ {} local copies)\n  gather+broadcast {:>10}   {:>12} ({} gather + {} broadcast)\n  gather+broadcast {:>10}   {:>12}   ÷ reshard\n  results match    {}\n",
            r.model,
            args.specs_text(&refit),
            out::count(r.tensors as u64),
            r.ranks,
            r.mode,
            r.threads,
            out::seconds(r.reshard_s),
            out::bytes(r.reshard_bytes),
            out::count(r.reshard_messages),
            out::bytes(r.reshard_bytes_local),
            out::seconds(r.gather_broadcast_s),
            out::bytes(r.gather_broadcast_bytes),
            out::bytes(r.gather_bytes),
            out::bytes(r.broadcast_bytes),
            format!("{:.2}×", r.gather_broadcast_over_reshard_time),
            format!("{:.2}×", r.gather_broadcast_over_reshard_bytes),
            if results_match {
                "yes: both leave identical destination bytes"
            } else {
                "NO: the two runs disagree"
            },
        ));
    }
    Ok(if results_match { 0 } else { 1 })
}

#[derive(Serialize)]
struct CopyBench {
    bytes: u64,
    row_bytes: u64,
    stride_bytes: u64,
    repeat: u32,
    memcpy_gbs: f64,
    contiguous_gbs: f64,
    pack_gbs: f64,
    unpack_gbs: f64,
    contiguous_over_memcpy: f64,
    pack_over_memcpy: f64,
    unpack_over_memcpy: f64,
}

/// Best wall time of `repeat` runs of `f`.
fn best(repeat: u32, mut f: impl FnMut()) -> Duration {
    (0..repeat)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn bench_copy(parsed: &Parsed) -> Result<u8, Failure> {
    let number = |name: &str, default: u64| -> Result<u64, Failure> {
        Ok(parsed
            .number::<u64>(name)
            .map_err(|e| usage("bench", e))?
            .unwrap_or(default))
    };
    let mib = number("mib", 256)?;
    let row = number("row", 4096)?;
    let pad = number("pad", 64)?;
    let repeat = u32::try_from(number("repeat", 5)?).unwrap_or(u32::MAX);
    if mib == 0 || row == 0 || repeat == 0 {
        return Err(usage(
            "bench",
            "--mib, --row and --repeat must be at least 1",
        ));
    }
    let bytes = mib << 20;
    if bytes % row != 0 {
        return Err(usage(
            "bench",
            format!("--row {row} does not divide --mib {mib} MiB into whole rows"),
        ));
    }
    let rows = bytes / row;
    let stride = row + pad;
    let strided_len = rows * stride;
    let alloc = |len: u64| -> Result<Vec<u8>, Failure> {
        let len = usize::try_from(len)
            .map_err(|_| Failure::Input("--mib is too large for this host".into()))?;
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| Failure::Input(format!("cannot allocate {len} bytes")))?;
        v.extend((0..len).map(|i| (i % 251) as u8));
        Ok(v)
    };
    let strided = alloc(strided_len)?;
    let contiguous = alloc(bytes)?;
    let mut out_contiguous = alloc(bytes)?;
    let mut out_strided = alloc(strided_len)?;

    let loc = |buffer| Loc {
        buffer,
        tensor: 0,
        offset: 0,
    };
    let grid = |src_stride, dst_stride| {
        [
            CopyDim {
                count: rows,
                src_stride,
                dst_stride,
            },
            CopyDim {
                count: row,
                src_stride: 1,
                dst_stride: 1,
            },
        ]
    };
    let pack = StridedCopy::new(
        loc(Buffer::Src),
        loc(Buffer::Staging),
        1,
        &grid(stride, row),
    );
    let unpack = StridedCopy::new(
        loc(Buffer::Staging),
        loc(Buffer::Dst),
        1,
        &grid(row, stride),
    );
    let whole = StridedCopy::new(loc(Buffer::Src), loc(Buffer::Dst), 1, &grid(row, row));

    let memcpy = best(repeat, || {
        out_contiguous.copy_from_slice(black_box(&contiguous));
        black_box(&out_contiguous);
    });
    let contiguous_time = best(repeat, || {
        copy_block(&whole, black_box(&contiguous), &mut out_contiguous);
        black_box(&out_contiguous);
    });
    let pack_time = best(repeat, || {
        copy_block(&pack, black_box(&strided), &mut out_contiguous);
        black_box(&out_contiguous);
    });
    let packed_right = (0..rows as usize).all(|r| {
        let (row, stride) = (row as usize, stride as usize);
        out_contiguous[r * row..(r + 1) * row] == strided[r * stride..r * stride + row]
    });
    let unpack_time = best(repeat, || {
        copy_block(&unpack, black_box(&contiguous), &mut out_strided);
        black_box(&out_strided);
    });
    let unpacked_right = (0..rows as usize).all(|r| {
        let (row, stride) = (row as usize, stride as usize);
        out_strided[r * stride..r * stride + row] == contiguous[r * row..(r + 1) * row]
    });
    if !(packed_right && unpacked_right) {
        return Err(Failure::Input(
            "copy_block produced wrong bytes (a bug in transport::host::copy_block)".into(),
        ));
    }
    let gbs = |t: Duration| bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9;
    let r = CopyBench {
        bytes,
        row_bytes: row,
        stride_bytes: stride,
        repeat,
        memcpy_gbs: gbs(memcpy),
        contiguous_gbs: gbs(contiguous_time),
        pack_gbs: gbs(pack_time),
        unpack_gbs: gbs(unpack_time),
        contiguous_over_memcpy: gbs(contiguous_time) / gbs(memcpy),
        pack_over_memcpy: gbs(pack_time) / gbs(memcpy),
        unpack_over_memcpy: gbs(unpack_time) / gbs(memcpy),
    };
    if parsed.flag("json") {
        out::print(&out::json(&r));
        return Ok(0);
    }
    out::print(&format!(
        "bench --copy: {mib} MiB in {row}-byte rows, strided side {stride} bytes apart, best of {repeat}\n  copy_from_slice (memcpy)   {:>7.2} GB/s\n  copy_block contiguous      {:>7.2} GB/s   {:.2}× memcpy\n  copy_block pack            {:>7.2} GB/s   {:.2}× memcpy   (strided → contiguous)\n  copy_block unpack          {:>7.2} GB/s   {:.2}× memcpy   (contiguous → strided)\n",
        r.memcpy_gbs,
        r.contiguous_gbs,
        r.contiguous_over_memcpy,
        r.pack_gbs,
        r.pack_over_memcpy,
        r.unpack_gbs,
        r.unpack_over_memcpy,
    ));
    Ok(0)
}
