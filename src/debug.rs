//! `NCCL_RESHARD_DEBUG=WARN|INFO|TRACE` logging to stderr, in NCCL's style:
//! `hostname:pid:tid NCCL_RESHARD INFO message`. Off by default; the level is read once.

use std::sync::OnceLock;

/// Log levels, least verbose first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Warn = 1,
    Info = 2,
    Trace = 3,
}

fn threshold() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        match std::env::var("NCCL_RESHARD_DEBUG")
            .as_deref()
            .map(str::to_ascii_uppercase)
            .as_deref()
        {
            Ok("WARN") => 1,
            Ok("INFO") => 2,
            Ok("TRACE") => 3,
            _ => 0,
        }
    })
}

/// True when messages at `level` are printed.
pub fn enabled(level: Level) -> bool {
    level as u8 <= threshold()
}

fn prefix() -> String {
    let mut host = [0u8; 256];
    // SAFETY: gethostname writes at most host.len() bytes.
    unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) };
    let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
    let host = String::from_utf8_lossy(&host[..end]).into_owned();
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::syscall(libc::SYS_gettid)) };
    format!("{host}:{pid}:{tid}")
}

/// Prints `message()` at `level` when enabled (the message is built only then).
pub fn log(level: Level, message: impl FnOnce() -> String) {
    if enabled(level) {
        let name = match level {
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Trace => "TRACE",
        };
        eprintln!("{} NCCL_RESHARD {name} {}", prefix(), message());
    }
}
