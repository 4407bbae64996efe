//! `ncclreshard`: check, inspect and time reshard plans described in JSON case files, and
//! simulate, run and measure model weight refits.
//!
//! Exit status: 0 on success, 1 when a check fails, 2 on a usage or input-file error.

mod args;
mod commands;
mod heatmap;
mod host_run;
mod models_json;
mod out;
mod work;

use std::process::ExitCode;

const VERSION: &str = ncclreshard::VERSION;

const HELP: &str = "\
ncclreshard — check, inspect, simulate and time Reshard plans

Usage: ncclreshard <COMMAND> [OPTIONS]

Commands:
  check       Plan, run on the host executor and verify every case of case files
  execute     Run one case on the host executor on given view bytes, write what it leaves
  layout      Show every rank's local shard (shape and global index runs)
  plan        Summarise rank programs and the traffic between ranks
  simulate    Estimate a model refit on a cluster: reshard vs NCCL M2N vs gather+broadcast
              vs the physical floor (simulated, calibrated against published measurements)
  calibrate   The published refit measurements next to what the simulator gives for them
  refit       Run a scaled-down model refit on the host, verify every byte, simulate it
  bench       Measure planning (--plan), host execution (--exec) and host copies (--copy)
  bench-plan  Time the planner on a generated many-tensor plan
  help        Show help for a command

Options:
  -h, --help     Show help (also `ncclreshard <COMMAND> --help`)
  -V, --version  Print the version

Case files are JSON; see `ncclreshard help check` for the format. Models are presets
(deepseek-v3, kimi-k2, qwen3-235b-a22b, qwen3-32b, llama-3.1-70b, dsv3-toy) or files;
see `ncclreshard help simulate`.
Exit status: 0 success, 1 a check failed, 2 usage or input-file error.
";

/// Why a command could not do its job; both kinds exit with status 2.
#[derive(Debug)]
pub enum Failure {
    /// The command line is wrong: the message is followed by a pointer to the command's help.
    Usage {
        command: &'static str,
        message: String,
    },
    /// An input file is unreadable or invalid, or the library rejected its contents.
    Input(String),
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => ExitCode::from(code),
        Err(Failure::Usage { command, message }) => {
            let help = if command.is_empty() {
                "ncclreshard --help".to_string()
            } else {
                format!("ncclreshard {command} --help")
            };
            eprintln!("ncclreshard: error: {message}\n(see `{help}`)");
            ExitCode::from(2)
        }
        Err(Failure::Input(message)) => {
            eprintln!("ncclreshard: error: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &[String]) -> Result<u8, Failure> {
    let Some((command, rest)) = args.split_first() else {
        eprint!("{HELP}");
        return Ok(2);
    };
    match command.as_str() {
        "-h" | "--help" => {
            out::print(HELP);
            Ok(0)
        }
        "-V" | "--version" => {
            out::print(&format!("ncclreshard {VERSION}\n"));
            Ok(0)
        }
        "help" => match rest.first().map(String::as_str) {
            None => {
                out::print(HELP);
                Ok(0)
            }
            Some(name) => match commands::find(name) {
                Some(cmd) => {
                    out::print(cmd.help);
                    Ok(0)
                }
                None => Err(Failure::Usage {
                    command: "",
                    message: format!("unknown command {name:?}"),
                }),
            },
        },
        name => {
            let cmd = commands::find(name).ok_or_else(|| Failure::Usage {
                command: "",
                message: format!("unknown command {name:?}"),
            })?;
            if args::wants_help(rest) {
                out::print(cmd.help);
                return Ok(0);
            }
            let parsed = args::parse(rest, cmd.options).map_err(|message| Failure::Usage {
                command: cmd.name,
                message,
            })?;
            (cmd.run)(&parsed)
        }
    }
}
