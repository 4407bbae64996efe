//! The deadlock detector: when an NCCL operation, a communicator init or a stream memory wait
//! (`cuStreamWaitValue32_v2`) is waiting and nothing anywhere in the emulated machine has made
//! progress for NCCL_RESHARD_EMU_DEADLOCK_SECONDS, it prints every rank's pending operations and
//! every blocked wait (its stream, address, condition and the value the word holds) and aborts
//! (a hang in CI becomes a report).

use crate::completion::progress_count;
use crate::config::config;
use crate::handles::lock;
use crate::memop::{self, Blocked};
use crate::nccl::comm::Comm;
use crate::nccl::ops::Op;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

fn ops() -> &'static Mutex<Vec<Weak<Op>>> {
    static OPS: OnceLock<Mutex<Vec<Weak<Op>>>> = OnceLock::new();
    OPS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Inits waiting for their clique, by registration id.
type WaitingInits = Mutex<Vec<(u64, Arc<Comm>)>>;

fn inits() -> &'static WaitingInits {
    static INITS: OnceLock<WaitingInits> = OnceLock::new();
    INITS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Registers an issued NCCL operation. Finished ones are swept when the list has doubled since
/// the last sweep, so registering stays O(1) amortized (groups can hold tens of thousands).
pub fn pending(op: &Arc<Op>) {
    static SWEPT: AtomicU64 = AtomicU64::new(0);
    start();
    let mut list = lock(ops());
    if list.len() as u64 >= 2 * SWEPT.load(Ordering::Relaxed) + 1024 {
        list.retain(|w| w.upgrade().is_some_and(|o| !o.done.is_done()));
        SWEPT.store(list.len() as u64, Ordering::Relaxed);
    }
    list.push(Arc::downgrade(op));
}

/// A waiting init; unregistered when dropped.
pub struct BlockedInit(u64);

impl Drop for BlockedInit {
    fn drop(&mut self) {
        lock(inits()).retain(|(id, _)| *id != self.0);
    }
}

pub fn blocked_init(comm: &Arc<Comm>) -> BlockedInit {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    start();
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    lock(inits()).push((id, comm.clone()));
    BlockedInit(id)
}

/// Starts the watchdog thread (once).
pub fn start() {
    static START: Once = Once::new();
    START.call_once(|| {
        let _ = std::thread::Builder::new()
            .name("emu-watchdog".into())
            .spawn(watch);
    });
}

/// What is waiting now: NCCL operations, inits, blocked stream memory waits.
struct Waiting {
    ops: Vec<Arc<Op>>,
    inits: Vec<Arc<Comm>>,
    waits: Vec<Arc<Blocked>>,
}

impl Waiting {
    fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.inits.is_empty() && self.waits.is_empty()
    }
}

fn waiting() -> Waiting {
    let ops: Vec<Arc<Op>> = lock(ops())
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|o| !o.done.is_done())
        .collect();
    let inits = lock(inits()).iter().map(|(_, c)| c.clone()).collect();
    Waiting {
        ops,
        inits,
        waits: memop::blocked_waits(),
    }
}

fn watch() {
    let limit = config().deadlock;
    let tick = Duration::from_millis(100)
        .min(limit / 4)
        .max(Duration::from_millis(10));
    let mut last = (progress_count(), Instant::now());
    loop {
        std::thread::sleep(tick);
        let now = progress_count();
        let waiting = waiting();
        if now != last.0 || waiting.is_empty() {
            last = (now, Instant::now());
            continue;
        }
        if last.1.elapsed() >= limit {
            report(&waiting, limit);
        }
    }
}

fn report(waiting: &Waiting, limit: Duration) -> ! {
    let mut text = format!(
        "deadlock: {} waiting and nothing has progressed for {:.1} s (NCCL_RESHARD_EMU_DEADLOCK_SECONDS). Pending:",
        if waiting.ops.is_empty() && waiting.inits.is_empty() {
            "stream work is"
        } else {
            "NCCL work is"
        },
        limit.as_secs_f64()
    );
    for c in &waiting.inits {
        text.push_str(&format!(
            "\n    ncclCommInit of rank {} on {}: waiting for rank(s) {:?} to join",
            c.rank,
            c.describe(),
            c.clique.missing()
        ));
    }
    let mut ops = waiting.ops.clone();
    ops.sort_by_key(|o| (o.comm.rank, o.order));
    for o in ops {
        text.push_str(&format!("\n    rank {}: {}", o.comm.rank, o.describe()));
    }
    for w in &waiting.waits {
        text.push_str(&format!("\n    {}", w.describe()));
    }
    crate::diag::fatal(text)
}
