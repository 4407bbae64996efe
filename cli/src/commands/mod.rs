//! The subcommands: each declares its name, help text and options, and a function to run.

mod bench;
mod bench_plan;
mod calibrate;
mod check;
mod execute;
mod layout;
mod plan;
mod refit;
pub mod refit_setup;
mod simulate;

use crate::args::{Opt, Parsed};
use crate::Failure;
use ncclreshard::Mode;
use ncclreshard_tools::case::{self, Case, CaseFile};
use std::path::Path;

pub struct Command {
    pub name: &'static str,
    pub help: &'static str,
    pub options: &'static [Opt],
    /// Returns the exit status on success.
    pub run: fn(&Parsed) -> Result<u8, Failure>,
}

const COMMANDS: [Command; 9] = [
    check::COMMAND,
    execute::COMMAND,
    layout::COMMAND,
    plan::COMMAND,
    simulate::COMMAND,
    calibrate::COMMAND,
    refit::COMMAND,
    bench::COMMAND,
    bench_plan::COMMAND,
];

pub fn find(name: &str) -> Option<&'static Command> {
    COMMANDS.iter().find(|c| c.name == name)
}

fn usage(command: &'static str, message: impl Into<String>) -> Failure {
    Failure::Usage {
        command,
        message: message.into(),
    }
}

/// The one FILE argument of `layout`/`plan`, loaded, with `--case` applied: a selected case
/// comes back as a single-case file.
fn load_one(parsed: &Parsed, command: &'static str) -> Result<CaseFile, Failure> {
    let [path] = parsed.positional.as_slice() else {
        return Err(usage(
            command,
            format!("expected one FILE, got {}", parsed.positional.len()),
        ));
    };
    let mut file = case::load(Path::new(path)).map_err(Failure::Input)?;
    if let Some(wanted) = parsed.value("case") {
        let found = file
            .cases
            .iter()
            .position(|c| c.name == wanted)
            .or_else(|| {
                wanted
                    .parse::<usize>()
                    .ok()
                    .filter(|&i| i < file.cases.len())
            });
        let Some(i) = found else {
            let names: Vec<&str> = file.cases.iter().map(|c| c.name.as_str()).collect();
            return Err(Failure::Input(format!(
                "{path}: no case named {wanted:?} (cases: {})",
                names.join(", ")
            )));
        };
        file = CaseFile {
            is_array: false,
            cases: vec![file.cases.swap_remove(i)],
        };
    }
    Ok(file)
}

/// `--mode` if given, else the case's own mode (the default mode when it has none).
fn chosen_mode(parsed: &Parsed, command: &'static str, case: &Case) -> Result<Mode, Failure> {
    match parsed.value("mode") {
        Some(text) => Mode::parse(text).map_err(|e| usage(command, format!("--mode: {e}"))),
        None => Ok(case.config.mode),
    }
}

/// Wraps per-case outputs in an array when the file held an array of cases.
fn per_file<T: serde::Serialize>(file: &CaseFile, mut items: Vec<T>) -> String {
    if file.is_array {
        crate::out::json(&items)
    } else {
        crate::out::json(&items.remove(0))
    }
}
