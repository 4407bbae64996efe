//! Long-running steps of `simulate`, `refit` and `bench`: spread over every core, with a
//! progress line on stderr.
//!
//! When stderr is a terminal the line is redrawn in place (`\r`) while the step runs; otherwise
//! (logs, tests) each step prints one line when it ends. Nothing goes to stdout, so `--json`
//! output stays clean.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Worker threads for CPU-bound steps: the number of CPUs.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How often a live progress line is redrawn.
const REDRAW: Duration = Duration::from_millis(100);

/// Runs `step` while reporting its progress as `label done/total` (`total` 0: elapsed time
/// only). `step` counts finished items in the counter it is given. Returns the step's result
/// and its wall time.
pub fn track<T: Send>(
    label: &str,
    total: usize,
    step: impl FnOnce(&AtomicUsize) -> T + Send,
) -> (T, Duration) {
    let live = std::io::stderr().is_terminal();
    let done = AtomicUsize::new(0);
    let started = Instant::now();
    let result = std::thread::scope(|scope| {
        let main = std::thread::current();
        let done = &done;
        let worker = scope.spawn(move || {
            let result = step(done);
            main.unpark();
            result
        });
        while !worker.is_finished() {
            if live {
                draw(
                    label,
                    done.load(Ordering::Relaxed),
                    total,
                    started.elapsed(),
                );
            }
            std::thread::park_timeout(REDRAW);
        }
        worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    });
    let took = started.elapsed();
    let finished = done.load(Ordering::Relaxed);
    let what = if total > 0 {
        format!("{finished}/{total}")
    } else {
        "done".to_string()
    };
    let end = if live { "\r\x1b[K" } else { "" };
    let mut err = std::io::stderr().lock();
    // A closed stderr only loses the progress line.
    let _ = writeln!(err, "{end}{label}: {what} in {:.2} s", took.as_secs_f64());
    (result, took)
}

fn draw(label: &str, done: usize, total: usize, elapsed: Duration) {
    const WIDTH: usize = 30;
    let line = if let Some(filled) = (done * WIDTH).checked_div(total) {
        let filled = filled.min(WIDTH);
        format!(
            "\r{label} [{}{}] {done}/{total} {:.1} s\x1b[K",
            "#".repeat(filled),
            "-".repeat(WIDTH - filled),
            elapsed.as_secs_f64()
        )
    } else {
        format!("\r{label} … {:.1} s\x1b[K", elapsed.as_secs_f64())
    };
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes()).and_then(|()| err.flush());
}

/// `f` over every item on [`threads`] threads, results in item order; each finished item
/// adds one to `done`. Items are handed out one at a time, so uneven items balance.
pub fn map<T: Sync, R: Send>(
    items: &[T],
    done: &AtomicUsize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let workers = threads().min(items.len()).max(1);
    let mut results: Vec<(usize, R)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return out;
                        };
                        out.push((i, f(item)));
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    results.sort_unstable_by_key(|&(i, _)| i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// Peak resident memory of this process in MiB (`VmHWM` of /proc/self/status); `None` where
/// the kernel does not report it.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}
