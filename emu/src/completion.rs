//! Completion flags of stream work, and the global progress counter the deadlock watchdog reads.

use crate::handles::lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// Set once when a piece of work has finished; waited on by streams that depend on it and by
/// synchronizing API calls.
#[derive(Default)]
pub struct Completion {
    done: Mutex<Option<Instant>>,
    cv: Condvar,
}

impl Completion {
    pub fn new() -> Self {
        Self::default()
    }

    /// A completion that is already done (work that had nothing to do).
    pub fn done() -> Self {
        let c = Self::new();
        c.complete();
        c
    }

    pub fn complete(&self) {
        *lock(&self.done) = Some(Instant::now());
        self.cv.notify_all();
        progress();
    }

    pub fn is_done(&self) -> bool {
        lock(&self.done).is_some()
    }

    /// When it completed (None while pending).
    pub fn time(&self) -> Option<Instant> {
        *lock(&self.done)
    }

    /// Blocks until done.
    pub fn wait(&self) {
        let mut done = lock(&self.done);
        while done.is_none() {
            done = self.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

static PROGRESS: AtomicU64 = AtomicU64::new(0);

/// Records that the emulated machine did something (watchdog input).
pub fn progress() {
    PROGRESS.fetch_add(1, Ordering::Relaxed);
}

/// The progress count so far.
pub fn progress_count() -> u64 {
    PROGRESS.load(Ordering::Relaxed)
}
