//! `ncclreshard refit`: a real refit of a scaled-down model on the host executor, every byte
//! verified, next to the simulated time of the full-size refit on a cluster.

use super::refit_setup::{self, RefitArgs, Views};
use super::simulate::{self, Simulation};
use super::{usage, Command};
use crate::args::{flag, value, Parsed};
use crate::heatmap::{self, Heatmap};
use crate::host_run;
use crate::out;
use crate::work;
use crate::Failure;
use serde::Serialize;
use std::io::Write;

pub const COMMAND: Command = Command {
    name: "refit",
    help: HELP,
    options: &[
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
        value("trials"),
        value("seed"),
        value("svg"),
        flag("no-simulate"),
        flag("json"),
    ],
    run,
};

/// Widths are divided by this unless `--scale` says otherwise. Measured on two cores
/// (release build), Qwen3-32B TP4·PP4·DP2 → TP4·DP8: 5 s at ÷32, 47 s at ÷16 (peak RSS
/// 8.7 GB, mostly the host executor's message copies and check's per-element verification).
const DEFAULT_SCALE: u64 = 32;

const HELP: &str = r#"Run a weight refit for real on this host, verify every byte, and simulate it full size

Usage: ncclreshard refit --model NAME|FILE --train SPEC --infer SPEC [OPTIONS]

1. Builds the refit of the model with every width divided by --scale (same layers, tensor
   names and parallel layouts, about scale² fewer bytes), plans every rank, fills every
   source view with values derived from each element's global index, runs all ranks as
   threads of the host executor and checks every destination element (and the bytes around
   strided views), like `ncclreshard check`.
2. Simulates the same refit at full size on --cluster: reshard vs NCCL M2N vs
   gather+broadcast vs the physical floor (see `ncclreshard simulate`; simulated, not
   measured: `ncclreshard calibrate` shows how well the model reproduces measurements).
Progress goes to stderr; the summary table to stdout.

Options:
  --model NAME|FILE  deepseek-v3, kimi-k2, qwen3-235b-a22b, qwen3-32b, llama-3.1-70b,
                     dsv3-toy, a HuggingFace config.json or an M2N *.model.json listing
                     (required)
  --train SPEC       Megatron-style training parallelism, e.g. tp4,pp4,dp2 (required)
  --infer SPEC       vLLM-style inference parallelism, e.g. tp4,dp8 (required)
  --system FILE      An NCCL M2N system_configs/*.json instead of --train and --infer
  --scale N          Divide widths (hidden, intermediate, vocabulary, heads, experts) by N
                     for the host run (default 32; 1 = full size, if memory allows)
  --cluster C        Cluster of the simulation: dgx-h100 (default), gb200-nvl72 or
                     key=value pairs (see `ncclreshard simulate --help`)
  --dtype NAME       Element type of the weights (default bfloat16)
  --infer-dtype D    What inference stores, converted on the way: fp8-block128 (DeepSeek-V3's
                     FP8 checkpoint: decoder linear weights as float8_e4m3fn in 128 × 128
                     blocks with FP32 scales), fp8-blockRxC, fp8-per-channel or a dtype (a
                     plain cast). The host run checks every converted byte and scale against
                     the reference quantizer; the simulation reports the bytes saved
  --experts E        stacked (default) or per-expert routed expert tensors
  --colocated        Inference runs on the training ranks
  --mode MODE        auto (default), staged or groupable
  --rounds N         Staged/auto: rounds to spread the data over (default 0: automatic)
  --no-relay         Send each replica its data across the network (no NVLink relays)
  --trials N         Monte Carlo trials of the simulation (default 5; 0: no jitter)
  --seed N           Seed of the trials (default 1)
  --svg FILE         Write the rank-to-rank traffic heatmap of the full-size plan (of the
                     host run's plan with --no-simulate) as SVG
  --no-simulate      Skip the full-size simulation
  --json             JSON output instead of the table
  -h, --help         Show this help

Exit status: 0 every destination byte checked out, 1 some did not, 2 usage or input error.

Example (the README's demo):
  ncclreshard refit --model qwen3-32b --train tp4,pp4,dp2 --infer tp4,dp8 --svg refit.svg
"#;

#[derive(Serialize)]
struct HostJson {
    model: String,
    scale: u64,
    /// What inference stores (`--infer-dtype`, else `--dtype`) and how many tensors convert.
    infer_dtype: String,
    converted_tensors: usize,
    tensors: usize,
    ranks: usize,
    model_bytes: u64,
    bytes_moved: u64,
    bytes_local: u64,
    messages: u64,
    messages_max_per_rank: u64,
    staged_ranks: usize,
    host_s: f64,
    plan_s: f64,
    fill_s: f64,
    verify_s: f64,
    gather_broadcast_bytes: u64,
    gather_broadcast_over_reshard_bytes: f64,
    elements_verified: u64,
    verified: bool,
    failures: Vec<String>,
}

#[derive(Serialize)]
struct SimJson {
    model: String,
    cluster: String,
    model_bytes: u64,
    fits: bool,
    reshard_s: Option<f64>,
    reshard_p90_s: Option<f64>,
    m2n_hierarchical_s: f64,
    m2n_direct_s: f64,
    gather_broadcast_s: f64,
    lower_bound_s: f64,
    lower_bound_binding: String,
    direct_bound_s: f64,
    with_engine_postprocess: simulate::WithPostprocessJson,
    bytes_total: u64,
    messages_max_per_rank: u64,
}

#[derive(Serialize)]
struct Output {
    train: String,
    infer: String,
    mode: &'static str,
    host: HostJson,
    simulated: Option<SimJson>,
    svg: Option<String>,
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let args = RefitArgs::parse(parsed, "refit")?;
    let scale = refit_setup::scale(parsed, "refit", DEFAULT_SCALE)?;
    let cluster = refit_setup::cluster(parsed, "refit")?;
    let mode = refit_setup::mode(parsed, "refit")?;
    let svg_path = parsed.value("svg");
    if svg_path == Some("") {
        return Err(usage("refit", "--svg needs a file name"));
    }
    // Opened now, so a path that cannot be written fails before the work, not after it.
    let svg_file = svg_path
        .map(|path| {
            std::fs::File::create(path)
                .map_err(|e| Failure::Input(format!("{path}: cannot write: {e}")))
        })
        .transpose()?;
    let simulate_too = !parsed.flag("no-simulate");
    let options = simulate::sim_options(parsed, "refit")?;
    let json = parsed.flag("json");

    // 1. The host run.
    let small = args.refit(scale)?;
    let tensors = &small.tensors;
    let scaled_name = if scale == 1 {
        args.model.name().to_string()
    } else {
        format!("{}/{scale}", args.model.name())
    };
    eprintln!(
        "refit {scaled_name}: {}, {} tensors, {} per copy",
        args.specs_text(&small),
        out::count(tensors.len() as u64),
        out::bytes(small.bytes()),
    );
    let conversions = args.conversions(&small, scale)?;
    let Some(run) = host_run::plan_fill_execute(
        tensors,
        &conversions,
        refit_setup::config_with_options(parsed, "refit", mode, &cluster)?,
    )?
    else {
        return Ok(1);
    };
    let (ranks, programs) = (&run.ranks, &run.programs);
    let verified = host_run::verify(tensors, &conversions, ranks, &run.buffers);
    let baseline = host_run::baseline_bytes(tensors);
    let bytes_moved: u64 = programs.iter().map(|p| p.bytes_sent()).sum();
    let host = HostJson {
        model: scaled_name,
        scale,
        infer_dtype: args.infer_dtype_name(),
        converted_tensors: conversions.iter().flatten().count(),
        tensors: tensors.len(),
        ranks: ranks.len(),
        model_bytes: small.bytes(),
        bytes_moved,
        bytes_local: programs.iter().map(|p| p.bytes_copied_locally()).sum(),
        messages: programs.iter().map(|p| p.sends.len() as u64).sum(),
        messages_max_per_rank: programs
            .iter()
            .map(|p| (p.sends.len() + p.recvs.len()) as u64)
            .max()
            .unwrap_or(0),
        staged_ranks: programs.iter().filter(|p| !p.unpacks.is_empty()).count(),
        host_s: run.execute.as_secs_f64(),
        plan_s: run.plan.as_secs_f64(),
        fill_s: run.fill.as_secs_f64(),
        verify_s: verified.took.as_secs_f64(),
        gather_broadcast_bytes: baseline.total(),
        gather_broadcast_over_reshard_bytes: if bytes_moved > 0 {
            baseline.total() as f64 / bytes_moved as f64
        } else {
            f64::NAN
        },
        elements_verified: verified.elements,
        verified: verified.failures.is_empty(),
        failures: verified.failures.clone(),
    };

    // 2. The full-size simulation.
    let full = if simulate_too {
        let refit = args.refit(1)?;
        eprintln!(
            "simulating {} full size on {}",
            args.model.name(),
            cluster.name
        );
        let config = refit_setup::config_with_options(parsed, "refit", mode, &cluster)?;
        let conversions = args.conversions(&refit, 1)?;
        Some((
            simulate::simulate(
                &refit,
                &conversions,
                &cluster,
                config,
                &options,
                Views::Separate,
            )?,
            refit.bytes(),
        ))
    } else {
        None
    };

    if let (Some(path), Some(mut file)) = (svg_path, svg_file) {
        let (programs, which) = match &full {
            Some((s, _)) => (
                &s.programs,
                format!("full-size plan, {} topology", cluster.name),
            ),
            None => (programs, format!("host run's plan ({})", host.model)),
        };
        let map = Heatmap {
            title: format!(
                "{} refit: train {} → infer {}",
                args.model.name(),
                args.train_text,
                args.infer_text
            ),
            subtitle: format!(
                "Rank-to-rank traffic of the {which}, mode {}, {} dtype, experts {}",
                mode.name(),
                args.options.dtype,
                args.experts_name()
            ),
            train: (
                format!("train {}", args.train_text),
                small.train_ranks.clone(),
            ),
            infer: (
                format!("infer {}", args.infer_text),
                small.infer_ranks.clone(),
            ),
            group: if cluster.nvlink_domain == cluster.gpus_per_node {
                ("node", cluster.gpus_per_node)
            } else {
                ("NVLink domain", cluster.nvlink_domain)
            },
            programs,
        };
        file.write_all(heatmap::svg(&map).as_bytes())
            .map_err(|e| Failure::Input(format!("{path}: cannot write: {e}")))?;
        eprintln!("wrote {path}");
    }

    let ok = host.verified;
    if json {
        let output = Output {
            train: args.train_text.clone(),
            infer: args.infer_text.clone(),
            mode: mode.name(),
            simulated: full.as_ref().map(|(s, bytes)| sim_json(&args, s, *bytes)),
            host,
            svg: svg_path.map(str::to_string),
        };
        out::print(&out::json(&output));
    } else {
        out::print(&table(
            &args,
            mode.name(),
            &small,
            &host,
            &verified,
            full.as_ref(),
        ));
    }
    for failure in &verified.failures {
        eprintln!("ncclreshard: verification failed: {failure}");
    }
    Ok(if ok { 0 } else { 1 })
}

fn sim_json(args: &RefitArgs, s: &Simulation, model_bytes: u64) -> SimJson {
    SimJson {
        model: args.model.name().to_string(),
        cluster: s.cluster.name.clone(),
        model_bytes,
        fits: s.reshard.fits(),
        reshard_s: simulate::finite(s.reshard.time_s),
        reshard_p90_s: simulate::finite(s.reshard.p90_s),
        m2n_hierarchical_s: s.m2n_hierarchical.sim.time_s,
        m2n_direct_s: s.m2n_direct.sim.time_s,
        gather_broadcast_s: s.baseline.time_s,
        lower_bound_s: s.bound.time_s,
        lower_bound_binding: s.bound.binding.to_string(),
        direct_bound_s: s.bound.direct_time_s,
        with_engine_postprocess: simulate::WithPostprocessJson::new(s),
        bytes_total: s.reshard.bytes_total,
        messages_max_per_rank: s.reshard.messages_max_per_rank,
    }
}

fn table(
    args: &RefitArgs,
    mode: &str,
    small: &ncclreshard_tools::models::Refit,
    host: &HostJson,
    verified: &host_run::Verified,
    full: Option<&(Simulation, u64)>,
) -> String {
    let mut text = format!(
        "refit {}: {}, mode {}\n\nHost run: {} (widths ÷ {}), every rank a thread, {} CPU threads\n",
        args.model.name(),
        args.specs_text(small),
        mode,
        host.model,
        host.scale,
        work::threads()
    );
    let row = |name: &str, value: String| format!("  {name:<24}{value}\n");
    text += &row("tensors", out::count(host.tensors as u64));
    if host.converted_tensors > 0 {
        text += &row(
            "infer dtype",
            format!(
                "{} ({} tensors converted on the way; converted bytes and scales checked against the reference quantizer)",
                host.infer_dtype,
                out::count(host.converted_tensors as u64)
            ),
        );
    }
    text += &row(
        "ranks",
        format!(
            "{} ({} train, {} infer)",
            host.ranks,
            small.train_ranks.len(),
            small.infer_ranks.len()
        ),
    );
    text += &row("weights (one copy)", out::bytes(host.model_bytes));
    text += &row(
        "bytes moved",
        format!(
            "{} between ranks + {} local copies",
            out::bytes(host.bytes_moved),
            out::bytes(host.bytes_local)
        ),
    );
    text += &row(
        "messages",
        format!(
            "{} (at most {} per rank, sends + receives); {} staged ranks",
            out::count(host.messages),
            host.messages_max_per_rank,
            host.staged_ranks
        ),
    );
    text += &row(
        "host time",
        format!(
            "{} executing (planning {}, filling {}, verifying {})",
            out::seconds(host.host_s),
            out::seconds(host.plan_s),
            out::seconds(host.fill_s),
            out::seconds(host.verify_s)
        ),
    );
    text += &row(
        "gather+broadcast bytes",
        format!(
            "{} ({:.2}× the reshard's)",
            out::bytes(host.gather_broadcast_bytes),
            host.gather_broadcast_over_reshard_bytes
        ),
    );
    text += &row(
        "verified",
        if verified.failures.is_empty() {
            format!(
                "{} elements on every destination rank: every byte OK",
                out::count(host.elements_verified)
            )
        } else {
            format!(
                "FAILED: {} of {} tensors have wrong bytes (first failures on stderr)",
                verified.bad_tensors, host.tensors
            )
        },
    );
    match full {
        Some((s, bytes)) => {
            text += &format!(
                "\nSimulated (not measured) at full size: {} ({} per copy) on {}\n",
                args.model.name(),
                out::bytes(*bytes),
                simulate::cluster_text(&s.cluster)
            );
            text += &simulate::estimates_text(s);
            text += &row(
                "reshard bytes",
                format!(
                    "{} in {} messages (at most {} per rank)",
                    out::bytes(s.reshard.bytes_total),
                    out::count(s.reshard.messages_total),
                    s.reshard.messages_max_per_rank
                ),
            );
        }
        None => text += "\n(full-size simulation skipped: --no-simulate)\n",
    }
    text
}
