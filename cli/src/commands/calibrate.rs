//! `ncclreshard calibrate`: every public measurement the simulator reproduces, published vs
//! simulated, with one parameter set.

use super::{usage, Command};
use crate::args::{flag, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard_tools::sim::calibrate::{self, CalibrationRow};
use serde::Serialize;

pub const COMMAND: Command = Command {
    name: "calibrate",
    help: HELP,
    options: &[flag("json")],
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

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    if !parsed.positional.is_empty() {
        return Err(usage("calibrate", "takes no FILE arguments"));
    }
    let rows: Vec<Row> = calibrate::calibrate()
        .map_err(|e| Failure::Input(e.to_string()))?
        .iter()
        .map(Row::new)
        .collect();
    if parsed.flag("json") {
        out::print(&out::json(&rows));
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
    out::print(&text);
    Ok(0)
}
