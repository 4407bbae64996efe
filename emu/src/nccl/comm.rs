//! Communicators and the cliques of ranks that share a unique id. Ranks are threads (or
//! successive calls of one thread inside a group); a clique is complete when all `nranks` ranks
//! have joined, and blocking inits wait for that, as NCCL's do.

use super::{fail, NResult, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS, SUCCESS};
use crate::completion::Completion;
use crate::context::Context;
use crate::handles::{self, lock, Registry};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

pub use ncclreshard_nccl_api::UNIQUE_ID_BYTES;

/// The ranks of one unique id, and the matching state of their operations.
pub struct Clique {
    pub id: [u8; UNIQUE_ID_BYTES],
    pub nranks: i32,
    members: Mutex<Vec<Option<Arc<Comm>>>>,
    joined: Condvar,
    /// Point-to-point matching per (sender, receiver): ops keyed by issue order.
    pub pairs: Mutex<HashMap<(i32, i32), super::ops::Pair>>,
    /// Collectives by sequence number.
    pub collectives: Mutex<HashMap<u64, super::ops::CollectiveSlot>>,
    /// The exclusion list each shrink of this clique was called with (by the shrink's number
    /// on the calling rank), and the first rank that passed it: every survivor must pass the
    /// same one.
    pub shrinks: Mutex<HashMap<u64, (Vec<i32>, i32)>>,
    /// The grow identifier `ncclCommGetUniqueId` made and no grow has consumed yet.
    pub grow_id: Mutex<Option<[u8; UNIQUE_ID_BYTES]>>,
    pub grow_ready: Condvar,
}

impl Clique {
    pub fn is_complete(&self) -> bool {
        lock(&self.members).iter().all(Option::is_some)
    }

    /// Blocks until every rank has joined (the watchdog reports it if that never happens).
    pub fn wait_complete(&self, waiter: &Arc<Comm>) {
        let entry = crate::watchdog::blocked_init(waiter);
        let mut members = lock(&self.members);
        while !members.iter().all(Option::is_some) {
            members = self.joined.wait(members).unwrap_or_else(|p| p.into_inner());
        }
        drop(members);
        drop(entry);
    }

    pub fn member(&self, rank: i32) -> Option<Arc<Comm>> {
        lock(&self.members).get(rank as usize).cloned().flatten()
    }

    /// Ranks that have not joined (for reports).
    pub fn missing(&self) -> Vec<i32> {
        lock(&self.members)
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_none())
            .map(|(r, _)| r as i32)
            .collect()
    }
}

/// Where a communicator stands (`ncclCommGetAsyncError`).
pub struct Status {
    pub async_error: i32,
    pub finalized: bool,
    pub aborted: bool,
    /// `ncclCommRevoke` was called: only destroy, abort and shrink are allowed now.
    pub revoked: bool,
}

/// Faults injected into one rank's communicator (`ncclreshardEmu*` controls in `faults.rs`).
#[derive(Default)]
pub struct CommFaults {
    /// The rank's process has stopped once this many of its operations were issued: its later
    /// operations never become active (a crash in the middle of a group).
    pub stop_after: Option<u64>,
    /// Each group of the rank's operations becomes active only this long after its stream
    /// reaches it (a slow rank).
    pub delay: Duration,
    /// Peers whose link to this rank is broken: transfers with them never complete and set
    /// the communicator's asynchronous error to ncclRemoteError.
    pub broken: HashSet<i32>,
}

/// One rank's communicator.
pub struct Comm {
    pub handle: usize,
    pub clique: Arc<Clique>,
    pub rank: i32,
    pub nranks: i32,
    pub device: i32,
    /// The device's primary context: NULL streams are its legacy stream.
    pub context: Arc<Context>,
    pub blocking: bool,
    pub status: Mutex<Status>,
    /// The thread whose open group this communicator has joined.
    pub owner: Mutex<Option<ThreadId>>,
    /// Next issue number per peer, for sends and for receives.
    pub send_seq: Mutex<HashMap<i32, u64>>,
    pub recv_seq: Mutex<HashMap<i32, u64>>,
    pub collective_seq: Mutex<u64>,
    /// Completions of issued operations (ncclCommDestroy/Finalize wait for them).
    pub outstanding: Mutex<Vec<Arc<Completion>>>,
    /// Operations issued so far (for `CommFaults::stop_after`).
    pub issued: AtomicU64,
    /// Shrinks this rank has called on the communicator so far.
    pub shrinks: Mutex<u64>,
    pub faults: Mutex<CommFaults>,
}

impl Comm {
    /// NCCL's `ncclCommEnsureReady`: a communicator whose last operation returned
    /// ncclInProgress may not be used until it reports success.
    pub fn ensure_ready(&self) -> NResult<()> {
        let st = lock(&self.status);
        if st.aborted {
            return fail(INVALID_USAGE, "communicator was aborted");
        }
        match st.async_error {
            IN_PROGRESS => fail(
                INVALID_ARGUMENT,
                "Attempt to use communicator before the previous operation returned ncclSuccess",
            ),
            SUCCESS => Ok(()),
            e => fail(e, "communicator has an asynchronous error"),
        }
    }

    pub fn set_async(&self, result: i32) {
        lock(&self.status).async_error = result;
        crate::completion::progress();
    }

    pub fn describe(&self) -> String {
        format!(
            "comm {:#x} (rank {} of {}, device {})",
            self.handle, self.rank, self.nranks, self.device
        )
    }

    /// Whether an operation issued on this communicator has not completed.
    pub fn has_outstanding(&self) -> bool {
        lock(&self.outstanding).iter().any(|c| !c.is_done())
    }

    /// Waits for every operation issued on this communicator.
    pub fn wait_outstanding(&self) {
        let pending: Vec<_> = std::mem::take(&mut *lock(&self.outstanding));
        for c in pending {
            c.wait();
        }
    }
}

fn cliques() -> &'static Mutex<HashMap<[u8; UNIQUE_ID_BYTES], Arc<Clique>>> {
    static C: OnceLock<Mutex<HashMap<[u8; UNIQUE_ID_BYTES], Arc<Clique>>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

pub fn registry() -> &'static Registry<Comm> {
    static R: OnceLock<Registry<Comm>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

pub fn get(handle: usize) -> NResult<Arc<Comm>> {
    if handle == 0 {
        return fail(INVALID_ARGUMENT, "comm argument is NULL");
    }
    registry().get(handle).map_or_else(
        || {
            fail(
                INVALID_ARGUMENT,
                format!("invalid communicator {handle:#x}"),
            )
        },
        Ok,
    )
}

/// What the emulator's unique ids start with.
pub const MARK: &[u8; 8] = b"EMUNCCL\0";

/// A fresh unique id of the emulator.
pub fn new_unique_id() -> [u8; UNIQUE_ID_BYTES] {
    ncclreshard_nccl_api::new_unique_id(MARK)
}

/// A clique id made from another (a shrink of a clique, by its number and exclusion list).
pub fn derived_id(parent: &[u8; UNIQUE_ID_BYTES], seq: u64, list: &[i32]) -> [u8; UNIQUE_ID_BYTES] {
    ncclreshard_nccl_api::derived_id(MARK, parent, seq, list)
}

/// Adds rank `rank` on `device` to the clique of `id` (created by its first rank), without
/// waiting for the others. The communicator is in progress until the clique is complete.
pub fn join(
    id: [u8; UNIQUE_ID_BYTES],
    nranks: i32,
    rank: i32,
    device: i32,
    blocking: bool,
) -> NResult<Arc<Comm>> {
    ncclreshard_nccl_api::check_rank(rank, nranks)?;
    if !id.starts_with(MARK) {
        return fail(
            INVALID_ARGUMENT,
            "the unique id does not come from ncclGetUniqueId of this process",
        );
    }
    crate::device::check(device).map_err(|_| super::NcclError {
        result: INVALID_ARGUMENT,
        message: format!("invalid device {device}"),
    })?;
    let context = crate::context::primary(device).map_err(|_| super::NcclError {
        result: INVALID_ARGUMENT,
        message: format!("invalid device {device}"),
    })?;
    let clique = lock(cliques())
        .entry(id)
        .or_insert_with(|| {
            Arc::new(Clique {
                id,
                nranks,
                members: Mutex::new(vec![None; nranks as usize]),
                joined: Condvar::new(),
                pairs: Mutex::new(HashMap::new()),
                collectives: Mutex::new(HashMap::new()),
                shrinks: Mutex::new(HashMap::new()),
                grow_id: Mutex::new(None),
                grow_ready: Condvar::new(),
            })
        })
        .clone();
    if clique.nranks != nranks {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "rank {rank} passed nranks {nranks} but the id's other ranks passed {}",
                clique.nranks
            ),
        );
    }
    let comm = Arc::new(Comm {
        handle: handles::next(),
        clique: clique.clone(),
        rank,
        nranks,
        device,
        context,
        blocking,
        status: Mutex::new(Status {
            async_error: IN_PROGRESS,
            finalized: false,
            aborted: false,
            revoked: false,
        }),
        owner: Mutex::new(None),
        send_seq: Mutex::new(HashMap::new()),
        recv_seq: Mutex::new(HashMap::new()),
        collective_seq: Mutex::new(0),
        outstanding: Mutex::new(Vec::new()),
        issued: AtomicU64::new(0),
        shrinks: Mutex::new(0),
        faults: Mutex::new(CommFaults::default()),
    });
    {
        let mut members = lock(&clique.members);
        if members[rank as usize].is_some() {
            return fail(
                INVALID_USAGE,
                format!("rank {rank} of this unique id has already joined"),
            );
        }
        members[rank as usize] = Some(comm.clone());
        if members.iter().all(Option::is_some) {
            lock(cliques()).remove(&id);
        }
    }
    clique.joined.notify_all();
    crate::completion::progress();
    registry().insert(comm.handle, comm.clone());
    crate::watchdog::start();
    Ok(comm)
}

/// Completes a joined communicator's init: waits for the clique, then marks it ready.
pub fn finish_init(comm: &Arc<Comm>) {
    comm.clique.wait_complete(comm);
    comm.set_async(SUCCESS);
}

/// The device an init on this thread uses: the current context's, else the runtime's.
pub fn calling_device() -> i32 {
    match crate::context::current() {
        Ok(c) => c.device,
        Err(_) => crate::context::runtime_device(),
    }
}
