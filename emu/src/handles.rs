//! Opaque handles. Every object the API hands out (context, stream, event, module, function,
//! graph, pool, communicator) gets a process-unique number that is never a host address the
//! caller could dereference, and is looked up in its type's registry: a handle of the wrong
//! type, a destroyed one or a made-up one is simply not found.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Handles start high and step by 64, so none is NULL, `CU_STREAM_LEGACY` (1) or
/// `CU_STREAM_PER_THREAD` (2).
static NEXT: AtomicUsize = AtomicUsize::new(0x0e11_0000_0000);

/// A new handle value, unique across all types.
pub fn next() -> usize {
    NEXT.fetch_add(64, Ordering::Relaxed)
}

/// The live objects of one type, by handle.
pub struct Registry<T> {
    map: Mutex<HashMap<usize, Arc<T>>>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<T> Registry<T> {
    fn lock(&self) -> MutexGuard<'_, HashMap<usize, Arc<T>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn insert(&self, handle: usize, value: Arc<T>) {
        self.lock().insert(handle, value);
    }

    pub fn get(&self, handle: usize) -> Option<Arc<T>> {
        self.lock().get(&handle).cloned()
    }

    pub fn remove(&self, handle: usize) -> Option<Arc<T>> {
        self.lock().remove(&handle)
    }

    /// Every live object (for reports and sweeps).
    pub fn all(&self) -> Vec<Arc<T>> {
        self.lock().values().cloned().collect()
    }
}

/// Locks a mutex, ignoring poisoning: a panic is already fatal (diag::boundary), so a poisoned
/// lock is only ever seen on the way to the abort.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
