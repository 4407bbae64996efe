//! Communicators and the cliques of ranks that share a unique id. Ranks are threads of this
//! process, each with the CUDA context current when it joined (any device; all on one is the
//! point). A clique is complete when all its ranks have joined; blocking inits wait for that,
//! nonblocking ones return `ncclInProgress` and complete on a helper thread, as NCCL's do.

use crate::cuda::{driver, Context};
use crate::exchange::{Exchange, Matcher};
use crate::report::{
    fail, lock, misuse, NResult, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, SUCCESS,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::ThreadId;

pub use ncclreshard_nccl_api::{UniqueId, UNIQUE_ID_BYTES};

/// What every id the stand-in makes starts with.
const MARK: &[u8; 8] = b"NCCLLOOP";

/// The ranks of one unique id and the matching of their operations.
pub struct Clique {
    /// Process-unique number, for reports and lock order.
    pub serial: u64,
    pub id: UniqueId,
    pub nranks: i32,
    members: Mutex<Vec<bool>>,
    joined: Condvar,
    /// Sends and receives per (sender, receiver), in issue order.
    pub matcher: Mutex<Matcher>,
    /// The exclusion list of each shrink (by its number on the calling rank) and the rank that
    /// passed it first: every survivor must pass the same.
    pub shrinks: Mutex<HashMap<u64, (Vec<i32>, i32)>>,
    /// The grow identifier `ncclCommGetUniqueId` made that no grow has consumed yet.
    pub grow_id: Mutex<Option<UniqueId>>,
    pub grow_ready: Condvar,
}

impl Clique {
    /// Blocks until every rank has joined (the watchdog reports it if that never happens).
    pub fn wait_complete(self: &Arc<Self>, rank: i32) {
        let _waiting = crate::watchdog::blocked_init(self, rank);
        let mut members = lock(&self.members);
        while !members.iter().all(|&m| m) {
            members = self.joined.wait(members).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Ranks that have not joined (for reports).
    pub fn missing(&self) -> Vec<i32> {
        lock(&self.members)
            .iter()
            .enumerate()
            .filter(|(_, &m)| !m)
            .map(|(r, _)| r as i32)
            .collect()
    }
}

/// Where a communicator stands.
pub struct Status {
    /// `ncclCommGetAsyncError`: `ncclInProgress` while an init, a nonblocking group or a revoke
    /// is under way, else success or the error.
    pub async_error: i32,
    /// `ncclCommRevoke` (or a shrink with `NCCL_SHRINK_ABORT`) was called: only destroy, abort
    /// and shrink are allowed now.
    pub revoked: bool,
}

/// One rank's communicator.
pub struct Comm {
    pub handle: usize,
    pub clique: Arc<Clique>,
    pub rank: i32,
    pub nranks: i32,
    pub device: i32,
    /// The context current on the thread that joined: the rank's device's.
    pub context: Context,
    pub blocking: bool,
    pub status: Mutex<Status>,
    /// The thread whose open group this communicator has joined.
    pub owner: Mutex<Option<ThreadId>>,
    /// Operations issued outside graphs and not yet known complete: (exchange, this rank posted
    /// first).
    pub ops: Mutex<Vec<(Arc<Exchange>, bool)>>,
    /// Shrinks this rank has called on the communicator so far.
    pub shrinks: Mutex<u64>,
}

impl Comm {
    /// NCCL's `ncclCommEnsureReady`: a communicator whose last call returned `ncclInProgress`
    /// may not be used until it reports success.
    pub fn ensure_ready(&self) -> NResult<()> {
        match lock(&self.status).async_error {
            SUCCESS => Ok(()),
            IN_PROGRESS => fail(
                INVALID_ARGUMENT,
                format!(
                    "{}: attempt to use the communicator before its previous operation returned ncclSuccess",
                    self.describe()
                ),
            ),
            e => fail(e, format!("{} has an asynchronous error", self.describe())),
        }
    }

    pub fn set_async(&self, result: i32) {
        lock(&self.status).async_error = result;
    }

    pub fn is_revoked(&self) -> bool {
        lock(&self.status).revoked
    }

    pub fn describe(&self) -> String {
        format!(
            "comm {:#x} (rank {} of {}, device {}, clique {})",
            self.handle, self.rank, self.nranks, self.device, self.clique.serial
        )
    }

    /// Forgets the operations that have completed; returns those that have not.
    pub fn pending(&self) -> Vec<(Arc<Exchange>, bool)> {
        let mut ops = lock(&self.ops);
        ops.retain(|(e, first)| !e.complete_for(*first));
        ops.clone()
    }

    /// Refuses what needs an idle communicator (NCCL may deadlock otherwise).
    pub fn require_idle(&self, what: &str) -> NResult<()> {
        let pending = self.pending();
        if pending.is_empty() {
            return Ok(());
        }
        misuse(
            INVALID_USAGE,
            format!(
                "{what} on {}: {} of its operations have not completed (the first: {}); NCCL requires none{}",
                self.describe(),
                pending.len(),
                pending[0].0.describe(),
                if what == "ncclCommShrink" {
                    "; shrink with NCCL_SHRINK_ABORT after a failure"
                } else {
                    ""
                }
            ),
        )
    }
}

fn cliques() -> &'static Mutex<HashMap<UniqueId, Arc<Clique>>> {
    static C: OnceLock<Mutex<HashMap<UniqueId, Arc<Clique>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn registry() -> &'static Mutex<HashMap<usize, Arc<Comm>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The communicator behind a handle.
pub fn get(handle: usize) -> NResult<Arc<Comm>> {
    if handle == 0 {
        return fail(INVALID_ARGUMENT, "comm argument is NULL");
    }
    match lock(registry()).get(&handle) {
        Some(c) => Ok(c.clone()),
        None => misuse(
            INVALID_ARGUMENT,
            format!("invalid communicator {handle:#x} (never made by the loopback stand-in, or destroyed)"),
        ),
    }
}

/// Every live communicator (for the watchdog).
pub fn all() -> Vec<Arc<Comm>> {
    lock(registry()).values().cloned().collect()
}

/// Forgets a destroyed or aborted communicator: its handle is refused from now on.
pub fn unregister(handle: usize) {
    lock(registry()).remove(&handle);
}

/// A fresh unique id of the stand-in.
pub fn new_unique_id() -> UniqueId {
    ncclreshard_nccl_api::new_unique_id(MARK)
}

/// The id of a shrink of a clique (by its number and exclusion list).
pub fn derived_id(parent: &UniqueId, seq: u64, list: &[i32]) -> UniqueId {
    ncclreshard_nccl_api::derived_id(MARK, parent, seq, list)
}

/// Adds rank `rank` of `nranks` to the clique of `id`, on the calling thread's context (the
/// rank's device), without waiting for the others.
pub fn join(id: UniqueId, nranks: i32, rank: i32, blocking: bool) -> NResult<Arc<Comm>> {
    ncclreshard_nccl_api::check_rank(rank, nranks)?;
    if !id.starts_with(MARK) {
        return misuse(
            INVALID_ARGUMENT,
            "the unique id does not come from this process's loopback stand-in (ncclGetUniqueId, ncclCommGetUniqueId): its ranks are threads of one process",
        );
    }
    let d = driver()?;
    let context = d.calling_context()?;
    let device = {
        let _current = d.push(context)?;
        d.current_device()?
    };
    crate::flags::ensure(context)?;
    {
        // Loaded before any rank of this context waits on a flag (copy.rs).
        let _current = d.push(context)?;
        crate::copy::function(context)?;
    }
    let clique = {
        static SERIAL: AtomicU64 = AtomicU64::new(1);
        lock(cliques())
            .entry(id)
            .or_insert_with(|| {
                Arc::new(Clique {
                    serial: SERIAL.fetch_add(1, Ordering::Relaxed),
                    id,
                    nranks,
                    members: Mutex::new(vec![false; nranks as usize]),
                    joined: Condvar::new(),
                    matcher: Mutex::new(Matcher::default()),
                    shrinks: Mutex::new(HashMap::new()),
                    grow_id: Mutex::new(None),
                    grow_ready: Condvar::new(),
                })
            })
            .clone()
    };
    if clique.nranks != nranks {
        return misuse(
            INVALID_ARGUMENT,
            format!(
                "rank {rank} passed nranks {nranks} but the id's other ranks passed {}",
                clique.nranks
            ),
        );
    }
    {
        let mut members = lock(&clique.members);
        if members[rank as usize] {
            return misuse(
                INVALID_USAGE,
                format!("rank {rank} of this unique id has already joined"),
            );
        }
        members[rank as usize] = true;
        if members.iter().all(|&m| m) {
            lock(cliques()).remove(&id);
        }
    }
    clique.joined.notify_all();
    static NEXT: AtomicUsize = AtomicUsize::new(0x4c00_0000_0000);
    let comm = Arc::new(Comm {
        handle: NEXT.fetch_add(64, Ordering::Relaxed),
        clique,
        rank,
        nranks,
        device,
        context,
        blocking,
        status: Mutex::new(Status {
            async_error: IN_PROGRESS,
            revoked: false,
        }),
        owner: Mutex::new(None),
        ops: Mutex::new(Vec::new()),
        shrinks: Mutex::new(0),
    });
    lock(registry()).insert(comm.handle, comm.clone());
    Ok(comm)
}

/// Completes a joined communicator's init: now (blocking: waits for every rank), or on a helper
/// thread (nonblocking: `ncclInProgress` until then). `then` runs once the clique is complete.
pub fn complete_init(comm: Arc<Comm>, then: impl FnOnce() + Send + 'static) -> NResult<i32> {
    if comm.blocking {
        comm.clique.wait_complete(comm.rank);
        then();
        comm.set_async(SUCCESS);
        return Ok(SUCCESS);
    }
    std::thread::Builder::new()
        .name("loopback-init".into())
        .spawn(move || {
            crate::report::boundary("nonblocking init", || {
                comm.clique.wait_complete(comm.rank);
                then();
                comm.set_async(SUCCESS);
            })
        })
        .map_err(|e| crate::report::NcclError {
            result: crate::report::SYSTEM_ERROR,
            message: format!("cannot start a thread: {e}"),
        })?;
    Ok(IN_PROGRESS)
}

/// The first thread that posts to a communicator in an open group owns it until the group
/// ends; another thread posting meanwhile uses it concurrently, which NCCL forbids.
pub fn claim(comm: &Comm, api: &str) {
    let me = std::thread::current().id();
    let mut owner = lock(&comm.owner);
    match *owner {
        Some(other) if other != me => crate::report::fatal(format_args!(
            "{api} on {}: the communicator is used from two threads at once (it is in another thread's open NCCL group); NCCL forbids concurrent use of a communicator",
            comm.describe()
        )),
        _ => *owner = Some(me),
    }
}

/// What a revoke (or an abort, or a shrink with `NCCL_SHRINK_ABORT`) does to the rank's
/// operations: the communicator takes no new ones, and each of its operations that nothing has
/// matched is released from the host, so its stream goes on. Operations already matched
/// complete when both streams reach them (the peer's progress or revoke sees to that): their
/// copies touch both ranks' buffers, which only the two streams reaching them makes safe.
pub fn revoke(comm: &Comm) {
    let _issuing = lock(&comm.clique.matcher);
    lock(&comm.status).revoked = true;
    for (exchange, first) in comm.pending() {
        if first {
            exchange.cancel_if_unmatched();
        }
    }
}
