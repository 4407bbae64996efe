//! `ncclreshard execute`: one case on the host executor with views the caller gives as files,
//! and what the executor leaves in the destination views written back. The host executor is
//! the specification; a transport outside the library (the Python package's torch transport)
//! runs the same case on the same bytes and compares every destination byte with these.

use super::{chosen_mode, load_one, usage, Command};
use crate::args::{value, Parsed};
use crate::out;
use crate::Failure;
use ncclreshard::exec::{rank_program, NoLimits, StagingLimit};
use ncclreshard::plan::{Config, Planner, RankProgram};
use ncclreshard::transport::host::execute;
use ncclreshard_tools::check::rank_buffers;
use std::path::{Path, PathBuf};

pub const COMMAND: Command = Command {
    name: "execute",
    help: HELP,
    options: &[
        value("input"),
        value("output"),
        value("case"),
        value("mode"),
    ],
    run,
};

const HELP: &str = r#"Run one case on the host executor on the caller's bytes and write what it leaves

Usage: ncclreshard execute FILE --input DIR --output DIR [--case NAME] [--mode MODE]

For testing another transport against the specification: every rank of the case is planned
and run on the host executor, its views read from files, and every destination view it leaves
is written to a file, byte for byte, to compare with what the other transport leaves. Ranks
are the plan's (a case with `config.failed_ranks` numbers the survivors). Files, for each rank
R that holds the view and tensor T:
  R.src.T   R's source view of tensor T: the view's extent in bytes (gaps of strided views
            included), in the tensor's dtype
  R.dst.T   R's destination view of tensor T as it starts (in its dst_dtype when it
            converts); T = ntensors + K is the scale view of the K-th tensor with scales
Every view a rank holds must be in --input with exactly its extent; --output receives the
R.dst.T files after the run. Prints `executed NAME ranks=N bytes_in=B bytes_out=B`.

Options:
  --input DIR   The views as they start
  --output DIR  Where the destination views are written after the run
  --case NAME   The case (name or index) when FILE holds several
  --mode MODE   groupable, staged or auto (default: the case's mode, else auto)
  -h, --help    Show this help

Exit status: 0 success, 1 the host executor failed, 2 usage or input error.
"#;

fn run(parsed: &Parsed) -> Result<u8, Failure> {
    let dir = |name: &str| {
        parsed
            .value(name)
            .map(PathBuf::from)
            .ok_or_else(|| usage("execute", format!("--{name} DIR is required")))
    };
    let (input, output) = (dir("input")?, dir("output")?);
    let file = load_one(parsed, "execute")?;
    let [case] = file.cases.as_slice() else {
        return Err(usage(
            "execute",
            format!(
                "FILE holds {} cases; choose one with --case",
                file.cases.len()
            ),
        ));
    };
    let config = Config {
        mode: chosen_mode(parsed, "execute", case)?,
        ..case.config.clone()
    };
    let tensors = case.specs();
    let conversions = case.conversions();
    let planner = Planner::with_conversions(tensors.clone(), conversions.clone(), config)
        .map_err(|e| Failure::Input(format!("{}: {e}", case.name)))?;
    let ranks = planner.ranks();
    let programs: Vec<RankProgram> = ranks
        .iter()
        .map(|&r| rank_program(&planner, r, StagingLimit::new(0), &NoLimits))
        .collect::<Result<_, _>>()
        .map_err(|e| Failure::Input(format!("{}: {e}", case.name)))?;
    let mut buffers = Vec::with_capacity(ranks.len());
    let mut bytes_in = 0u64;
    for &rank in &ranks {
        // Allocated as `check` allocates them, so every view has its extent; then replaced by
        // the caller's bytes.
        let mut memory = rank_buffers(&tensors, Some(&conversions), rank)
            .map_err(|e| Failure::Input(format!("{}: rank {rank}: {e}", case.name)))?;
        for (side, views) in [("src", &mut memory.src), ("dst", &mut memory.dst)] {
            for (t, view) in views.iter_mut().enumerate() {
                if view.is_empty() {
                    continue;
                }
                let path = input.join(format!("{rank}.{side}.{t}"));
                let bytes = read_view(&path, view.len())?;
                bytes_in += bytes.len() as u64;
                *view = bytes;
            }
        }
        buffers.push(memory);
    }
    if let Err(e) = execute(&programs, &mut buffers) {
        eprintln!("ncclreshard: {}: the host executor failed: {e}", case.name);
        return Ok(1);
    }
    std::fs::create_dir_all(&output)
        .map_err(|e| Failure::Input(format!("{}: cannot create: {e}", output.display())))?;
    let mut bytes_out = 0u64;
    for (&rank, memory) in ranks.iter().zip(&buffers) {
        for (t, view) in memory.dst.iter().enumerate() {
            if view.is_empty() {
                continue;
            }
            let path = output.join(format!("{rank}.dst.{t}"));
            std::fs::write(&path, view)
                .map_err(|e| Failure::Input(format!("{}: cannot write: {e}", path.display())))?;
            bytes_out += view.len() as u64;
        }
    }
    out::line(&format!(
        "executed {}  ranks={} bytes_in={bytes_in} bytes_out={bytes_out}",
        case.name,
        ranks.len()
    ));
    Ok(0)
}

/// The file's bytes, which must be a view's whole extent.
fn read_view(path: &Path, extent: usize) -> Result<Vec<u8>, Failure> {
    let bytes = std::fs::read(path).map_err(|e| {
        Failure::Input(format!(
            "{}: cannot read ({e}); the rank holds this view ({extent} bytes)",
            path.display()
        ))
    })?;
    if bytes.len() != extent {
        return Err(Failure::Input(format!(
            "{}: {} bytes; the view's extent is {extent}",
            path.display(),
            bytes.len()
        )));
    }
    Ok(bytes)
}
