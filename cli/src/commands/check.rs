//! `ncclreshard check`: plan every case, run all ranks on the host executor, verify every
//! destination byte (`ncclreshard_tools::check::check`).

use super::{usage, Command};
use crate::args::{flag, value, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard::plan::GROUPABLE_MAX_MESSAGES_PER_RANK;
use ncclreshard::quant::Conversion;
use ncclreshard::{Config, Mode, TensorSpec};
use ncclreshard_tools::case;
use ncclreshard_tools::check::CheckReport;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

pub const COMMAND: Command = Command {
    name: "check",
    help: HELP,
    options: &[value("jobs"), flag("quiet")],
    run,
};

const HELP: &str = r#"Plan, execute on the host and verify every case of the given case files

Usage: ncclreshard check [OPTIONS] FILE...

For each case, every rank's program is planned, all ranks run on the host executor, and every
destination element (and every byte around strided views) is compared with the expected
value. A case whose config gives no mode runs once per mode (groupable, staged, auto), each
counted as a case and named NAME[mode]. A case with `config.failed_ranks` checks the
survivors' plan: the failed ranks' positions are holes, the others renumbered as
ncclCommShrink renumbers them, and every surviving destination byte is checked.

Prints one line per case:
  ok   NAME  ranks=… elements=… bytes_sent=… local_bytes=… messages=… staged_ranks=… ms=…
  refused NAME: ERROR   (a documented limit, not a failure: groupable mode past its message cap,
                        or a survivors' plan (config.failed_ranks, null ranks) whose data no
                        survivor holds)
  FAIL NAME: ERROR
then `N passed, M failed` (and `, K refused` when some were).

Options:
  --jobs N   Cases checked at once (default: the number of CPUs)
  --quiet    Print only failures and the summary
  -h, --help Show this help

Exit status: 0 all passed, 1 some case failed, 2 usage or input-file error.

Case file format (JSON): one case or an array of cases.
  single tensor: {"name"?, "shape": [..], "dtype": "bfloat16", "src": SIDE, "dst": SIDE,
                  "dst_dtype"?, "quant"?: QUANT, "config"?: CONFIG}
  multi-tensor:  {"name"?, "tensors": [{"name"?, "shape", "dtype", "src", "dst",
                  "dst_dtype"?, "quant"?}, ..], "config"?: CONFIG}
  SIDE:   {"mesh": [..], "ranks": [..] (null: a rank that is gone) | "first_rank": N
           (default 0, contiguous), "placements": ["Replicate", "Shard(0)",
           "StridedShard(0,2)", "ShardBlocks(0,288)", ..],
           "strides"?: [..] (element strides of every rank's local view)}
  QUANT:  {"scheme": "none"|"per_tensor"|"per_channel"|"block", "block"?: [rows, cols],
           "scale_format"?: "float32"|"e8m0", "scale_inverse"?: bool, "scale_layout"?: SIDE}
           (docs/quantization.md; needs "dst_dtype")
  CONFIG: {"mode"?: "groupable"|"staged"|"auto" (absent: every mode),
           "ranks_per_node"?: N | "node_of_rank"?: [..], "split_min_bytes"?: N,
           "rounds"?: N, "relay"?: bool, "sender_barrier"?: bool, "failed_ranks"?: [..]}
dtype names are torch's (bfloat16, float32, int8, float8_e4m3fn, ...). Unknown keys are
errors.
"#;

struct Job {
    name: String,
    tensors: Vec<TensorSpec>,
    conversions: Vec<Option<Conversion>>,
    config: Config,
}

/// A checked case, or why it failed.
enum Outcome {
    Passed(CheckReport, f64),
    /// Groupable mode refused the case for needing too many messages (a documented limit).
    Refused(String),
    Failed(String),
}

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    if parsed.positional.is_empty() {
        return Err(usage("check", "expected at least one FILE"));
    }
    let jobs_wanted = parsed
        .number::<usize>("jobs")
        .map_err(|e| usage("check", e))?;
    let quiet = parsed.flag("quiet");
    let mut jobs = Vec::new();
    let mut errors = Vec::new();
    for path in &parsed.positional {
        match case::load(Path::new(path)) {
            Ok(file) => {
                for case in &file.cases {
                    let tensors = case.specs();
                    let conversions = case.conversions();
                    for (name, config) in case.variants() {
                        jobs.push(Job {
                            name,
                            tensors: tensors.clone(),
                            conversions: conversions.clone(),
                            config,
                        });
                    }
                }
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(Failure::Input(errors.join("\nncclreshard: error: ")));
    }

    let workers = jobs_wanted
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let (tx, rx) = mpsc::channel::<(usize, Outcome)>();
    let (mut passed, mut failed, mut refused) = (0usize, 0usize, 0usize);
    std::thread::scope(|scope| {
        for _ in 0..workers {
            let (tx, next, jobs) = (tx.clone(), &next, &jobs);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                if tx.send((i, check_one(job))).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        // Results arrive in any order; print them in case order as soon as possible.
        let mut results: Vec<Option<Outcome>> = jobs.iter().map(|_| None).collect();
        let mut shown = 0;
        for (i, outcome) in rx {
            results[i] = Some(outcome);
            while let Some(Some(outcome)) = results.get_mut(shown).map(Option::take) {
                let name = &jobs[shown].name;
                match outcome {
                    Outcome::Passed(r, ms) => {
                        passed += 1;
                        if !quiet {
                            out::line(&format!(
                                "ok   {name}  ranks={} elements={} bytes_sent={} local_bytes={} messages={} staged_ranks={} ms={ms:.1}",
                                r.ranks, r.elements_checked, r.bytes_sent, r.bytes_copied_locally, r.messages, r.staged_ranks
                            ));
                        }
                    }
                    Outcome::Refused(e) => {
                        refused += 1;
                        if !quiet {
                            out::line(&format!("refused {name}: {e}"));
                        }
                    }
                    Outcome::Failed(e) => {
                        failed += 1;
                        out::line(&format!("FAIL {name}: {e}"));
                    }
                }
                shown += 1;
            }
        }
    });
    if refused > 0 {
        out::line(&format!(
            "{passed} passed, {failed} failed, {refused} refused"
        ));
    } else {
        out::line(&format!("{passed} passed, {failed} failed"));
    }
    Ok(u8::from(failed > 0))
}

/// Checks one job; a panic inside the library is reported as a failure of that case.
fn check_one(job: &Job) -> Outcome {
    let started = Instant::now();
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        ncclreshard_tools::check::check_with_conversions(
            &job.tensors,
            &job.conversions,
            &job.config,
        )
    }));
    let ms = started.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(Ok(report)) => Outcome::Passed(report, ms),
        Ok(Err(e))
            if job.config.mode == Mode::Groupable
                && e.message.contains(&format!(
                    "groupable mode needs more than {GROUPABLE_MAX_MESSAGES_PER_RANK} messages"
                )) =>
        {
            Outcome::Refused(e.to_string())
        }
        // A survivors' plan that no survivor can serve (docs/resilience.md).
        Ok(Err(e)) if e.message.contains("no surviving rank holds") => {
            Outcome::Refused(e.to_string())
        }
        Ok(Err(e)) => Outcome::Failed(e.to_string()),
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Outcome::Failed(format!("the library panicked (a bug): {message}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_help_names_every_key_a_case_file_may_have() {
        let keys = case::TENSOR_KEYS
            .iter()
            .chain(&case::QUANT_KEYS)
            .chain(&case::SIDE_KEYS)
            .chain(&case::CONFIG_KEYS);
        for key in keys {
            assert!(
                HELP.contains(&format!("\"{key}\"")),
                "{key} missing from the help"
            );
        }
    }
}
