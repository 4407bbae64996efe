//! The stand-in's own hang detector, for real GPUs (where nothing else would speak): when
//! operations are pending and none has completed for `NCCL_LOOPBACK_TIMEOUT_SECONDS` (default
//! 60; 0: never), it prints every pending operation with the flag it waits for, and every init
//! still waiting for ranks, then aborts. It reads the flags from the host every 100 ms, which
//! also gives back the slots of finished exchanges.

use crate::comm::Clique;
use crate::report::lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

static PROGRESS: AtomicU64 = AtomicU64::new(0);

/// An exchange finished, or a clique completed.
pub fn progress() {
    PROGRESS.fetch_add(1, Ordering::Relaxed);
}

/// Inits waiting for their clique: (id, clique, rank).
type Inits = Mutex<Vec<(u64, Arc<Clique>, i32)>>;

fn inits() -> &'static Inits {
    static INITS: OnceLock<Inits> = OnceLock::new();
    INITS.get_or_init(Default::default)
}

/// A waiting init, unregistered when dropped.
pub struct BlockedInit(u64);

impl Drop for BlockedInit {
    fn drop(&mut self) {
        lock(inits()).retain(|(id, ..)| *id != self.0);
        progress();
    }
}

pub fn blocked_init(clique: &Arc<Clique>, rank: i32) -> BlockedInit {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    start();
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    lock(inits()).push((id, clique.clone(), rank));
    BlockedInit(id)
}

fn timeout() -> Option<Duration> {
    let seconds = std::env::var("NCCL_LOOPBACK_TIMEOUT_SECONDS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(60.0);
    (seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
}

/// Starts the watchdog thread (once).
pub fn start() {
    static START: Once = Once::new();
    START.call_once(|| {
        let Some(limit) = timeout() else { return };
        let _ = std::thread::Builder::new()
            .name("loopback-watchdog".into())
            .spawn(move || watch(limit));
    });
}

fn watch(limit: Duration) {
    let mut last = (PROGRESS.load(Ordering::Relaxed), Instant::now());
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let pending = crate::exchange::sweep();
        note_streams(&pending);
        let waiting: Vec<(Arc<Clique>, i32)> = lock(inits())
            .iter()
            .map(|(_, c, r)| (c.clone(), *r))
            .collect();
        let now = PROGRESS.load(Ordering::Relaxed);
        if now != last.0 || (pending.is_empty() && waiting.is_empty()) {
            last = (now, Instant::now());
            continue;
        }
        if last.1.elapsed() < limit {
            continue;
        }
        let mut text = format!(
            "hang: operations are pending and none has completed for {:.0} s (NCCL_LOOPBACK_TIMEOUT_SECONDS). Pending:",
            limit.as_secs_f64()
        );
        for (clique, rank) in &waiting {
            text.push_str(&format!(
                "\n    ncclCommInit of rank {rank} of clique {}: waiting for rank(s) {:?} to join",
                clique.serial,
                clique.missing()
            ));
        }
        for e in &pending {
            text.push_str(&format!("\n    {}", e.describe()));
        }
        crate::report::fatal(text);
    }
}

/// On a GPU, streams beyond `CUDA_DEVICE_MAX_CONNECTIONS` (default 8, at most 32) share hardware
/// queues, and a wait at the head of a shared queue holds the work of the streams behind it:
/// ranks on one GPU could then wait for each other forever. Says so once, when more streams
/// than that have the stand-in's operations in flight at once (a hint: streams without waits
/// share the queues too).
fn note_streams(pending: &[Arc<crate::exchange::Exchange>]) {
    static WARNED: Once = Once::new();
    if WARNED.is_completed() {
        return;
    }
    let connections = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(8);
    let mut streams: Vec<(usize, usize)> = pending.iter().flat_map(|e| e.streams()).collect();
    streams.sort_unstable();
    streams.dedup();
    if streams.len() > connections {
        WARNED.call_once(|| {
            crate::report::report(format_args!(
                "WARNING: {} streams have operations of the stand-in in flight but CUDA_DEVICE_MAX_CONNECTIONS is {connections}: on a GPU, streams then share hardware queues and a wait may hold another rank's work behind it (set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA initialises)",
                streams.len()
            ))
        });
    }
}
