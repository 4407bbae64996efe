//! `ncclreshard calibrate`: every public measurement the simulator reproduces, published vs
//! simulated, with one parameter set.

use super::refit_setup::{self, RefitArgs};
use super::simulate::{simulate, DEFAULT_TRIALS};
use super::{usage, Command};
use crate::args::{flag, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard::Mode;
use ncclreshard_tools::sim::calibrate::{self, CalibrationRow, Comparison};
use ncclreshard_tools::sim::{Cluster, SimOptions};
use serde::Serialize;

pub const COMMAND: Command = Command {
    name: "calibrate",
    help: HELP,
    options: &[flag("json"), flag("compare")],
    run,
};

const HELP: &str = r#"Compare the simulator with every public measurement it can reproduce

Usage: ncclreshard calibrate [--json]

Simulates each published refit measurement (NeMo RL's gather+broadcast and nccl_reshard
refits, NCCL M2N's reshard_model_bench, hierarchical and direct) on its cluster with the
simulator's one parameter set and prints published vs simulated seconds and their ratio. The
published number is the middle of the published range. Rows marked "sets" fixed one of the
simulator's uncertain parameters (a fit, not a prediction); docs/simulator.md §6 gives the
sources and explains any row outside ±25 %.

Options:
  --json       JSON array of rows {"name", "published_s", "simulated_s", "ratio", ...}
  --compare    Also the comparisons: published refits by other systems beside our plan on
               the same shape, simulated, and its floor (not calibration rows: nothing is
               fitted to them; plans hundreds of ranks, a minute or more). JSON rows with
               "comparison": true, "floor_s" and "note"
  -h, --help   Show this help

Exit status: 0 (the table is a report, whatever the ratios), 2 usage error.

Example:
  ncclreshard calibrate
"#;

/// The window `ncclreshard calibrate` and its tests hold rows to.
const WINDOW: f64 = 0.25;

#[derive(Serialize)]
struct Row {
    name: &'static str,
    published_s: f64,
    simulated_s: f64,
    ratio: f64,
    published_low_s: f64,
    published_high_s: f64,
    within_25_percent: bool,
    /// The uncertain parameter this row set, if any.
    sets: Option<&'static str>,
    model: &'static str,
    train: &'static str,
    infer: &'static str,
    cluster: &'static str,
    source: &'static str,
}

impl Row {
    fn new(r: &CalibrationRow) -> Row {
        let m = &r.measurement;
        Row {
            name: m.name,
            published_s: r.published_s,
            simulated_s: r.simulated_s,
            ratio: r.ratio,
            published_low_s: m.low_s,
            published_high_s: m.high_s,
            within_25_percent: (r.ratio - 1.0).abs() <= WINDOW,
            sets: m.sets,
            model: m.model,
            train: m.train,
            infer: m.infer,
            cluster: m.cluster,
            source: m.source,
        }
    }
}

/// A comparison row: a published refit of another system, our plan's simulated time on the
/// same shape and that shape's floor.
#[derive(Serialize)]
struct ComparisonRow {
    name: &'static str,
    comparison: bool,
    published_s: f64,
    simulated_s: f64,
    /// `simulated_s / published_s`.
    ratio: f64,
    floor_s: f64,
    model: &'static str,
    train: &'static str,
    infer: &'static str,
    infer_dtype: &'static str,
    cluster: &'static str,
    source: &'static str,
    note: &'static str,
}

fn compare(c: &Comparison) -> Result<ComparisonRow, Failure> {
    let args = RefitArgs::preset(c.model, c.train, c.infer, c.infer_dtype)?;
    let cluster = Cluster::parse(c.cluster).map_err(|e| Failure::Input(e.to_string()))?;
    let refit = args.refit(1)?;
    let conversions = args.conversions(&refit, 1)?;
    let options = SimOptions {
        trials: DEFAULT_TRIALS,
        ..SimOptions::default()
    };
    let s = simulate(
        &refit,
        &conversions,
        &cluster,
        refit_setup::config(Mode::Auto, &cluster),
        &options,
        refit_setup::Views::Separate,
    )?;
    Ok(ComparisonRow {
        name: c.name,
        comparison: true,
        published_s: c.published_s,
        simulated_s: s.reshard.time_s,
        ratio: s.reshard.time_s / c.published_s,
        floor_s: s.bound.time_s,
        model: c.model,
        train: c.train,
        infer: c.infer,
        infer_dtype: c.infer_dtype,
        cluster: c.cluster,
        source: c.source,
        note: c.note,
    })
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    if !parsed.positional.is_empty() {
        return Err(usage("calibrate", "takes no FILE arguments"));
    }
    let rows: Vec<Row> = calibrate::calibrate()
        .map_err(|e| Failure::Input(e.to_string()))?
        .iter()
        .map(Row::new)
        .collect();
    let comparisons: Vec<ComparisonRow> = if parsed.flag("compare") {
        calibrate::COMPARISONS
            .iter()
            .map(compare)
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    if parsed.flag("json") {
        let value = |v: serde_json::Result<serde_json::Value>| v.expect("rows serialise");
        let mut all: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| value(serde_json::to_value(r)))
            .collect();
        all.extend(comparisons.iter().map(|c| value(serde_json::to_value(c))));
        out::print(&out::json(&all));
        return Ok(0);
    }
    let mut text = format!(
        "{:<66} {:>15} {:>10} {:>6}\n",
        "measurement (simulated with one parameter set)", "published", "simulated", "ratio"
    );
    for r in &rows {
        let published = if r.published_low_s == r.published_high_s {
            format!("{:.3} s", r.published_s)
        } else {
            format!("{:.2}–{:.2} s", r.published_low_s, r.published_high_s)
        };
        let mark = match (r.within_25_percent, r.sets) {
            (false, _) => "  outside ±25 %",
            (true, Some(_)) => "  (sets a parameter)",
            (true, None) => "",
        };
        text += &format!(
            "{:<66} {:>15} {:>10} {:>5.2}×{mark}\n",
            r.name,
            published,
            out::seconds(r.simulated_s),
            r.ratio
        );
    }
    let within = rows.iter().filter(|r| r.within_25_percent).count();
    text += &format!(
        "\n{within} of {} rows within ±25 %; parameters and sources: docs/simulator.md\n",
        rows.len()
    );
    if !comparisons.is_empty() {
        text += &format!(
            "\n{:<66} {:>15} {:>10} {:>10}\n",
            "comparison (theirs published, ours simulated)", "theirs", "ours", "floor"
        );
        for c in &comparisons {
            text += &format!(
                "{:<66} {:>15} {:>10} {:>10}\n  {} {} → {}, {}: {}\n",
                c.name,
                format!("{:.3} s", c.published_s),
                out::seconds(c.simulated_s),
                out::seconds(c.floor_s),
                c.model,
                c.train,
                c.infer,
                c.infer_dtype,
                c.note
            );
        }
    }
    out::print(&text);
    Ok(0)
}
