//! Device memory: a reserved range of address space that is never mapped, and a table of
//! allocations inside it whose bytes live elsewhere in host memory.
//!
//! A device pointer is a number in the reserved range, so dereferencing it on the host faults;
//! every emulated access (copies, memsets, kernel loads and stores, NCCL transfers) goes through
//! [`translate`], which finds the allocation that holds the whole range, checks its state
//! (live, not yet allocated in stream order, freed) and its device, and that no synchronous
//! pageable copy is still writing the range, and returns the host address of the bytes.
//! Addresses are never reused (the range is 16 TiB) and allocations are separated by unmapped
//! gaps, so an off-by-one lands in no allocation and a dangling pointer still names the
//! allocation it came from. Pinned host memory (`cuMemHostAlloc`) is in the same table, at its
//! host address (unified addressing): kernels and NCCL may use it as mapped memory.

use crate::config::config;
use crate::errors::{err, CuResult};
use crate::handles::lock;
use cudarc::driver::sys::CUresult;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// Where an allocation's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Device(i32),
    /// Pinned, mapped host memory (`cuMemHostAlloc`, `cudaMallocHost`).
    Host,
}

/// The allocation exists (its address is handed out) but may not be used yet: a
/// `cuMemAllocAsync` not yet reached in stream order, or a graph allocation outside a replay's
/// alloc..free window.
pub const INACTIVE: u8 = 0;
/// Usable.
pub const LIVE: u8 = 1;
/// Gone for good; the bytes are unmapped.
pub const FREED: u8 = 2;

/// A synchronous `cuMemcpyHtoD` from pageable memory whose device write is still queued on the
/// legacy stream.
#[derive(Clone, Debug)]
pub struct PendingWrite {
    pub id: u64,
    pub start: u64,
    pub end: u64,
    pub what: String,
}

/// One allocation.
pub struct Allocation {
    pub base: u64,
    pub size: u64,
    pub place: Place,
    /// The handle of the context it was allocated in.
    pub context: usize,
    /// The call that allocated it, for reports ("cuMemAlloc_v2 (4096 bytes)").
    pub origin: String,
    host: usize,
    mapped_len: usize,
    state: AtomicU8,
    /// Why it is not live, for reports.
    note: Mutex<String>,
    pending: Mutex<Vec<PendingWrite>>,
    /// Which other devices may access it directly (NCCL's peer-to-peer transport between GPUs
    /// of one process): unset for `cuMemAlloc` memory (peer access, which NCCL enables, covers
    /// it); the owning pool's grants for stream-ordered and graph allocations, which need
    /// `cuMemPoolSetAccess`.
    peers: OnceLock<Arc<AtomicU64>>,
    /// Its bytes count against the device's memory. A graph allocation's do only from the
    /// first launch that reaches its allocation node until `cuDeviceGraphMemTrim` finds it
    /// unused, as CUDA backs graph memory with physical pages lazily and keeps them for reuse.
    counted: AtomicBool,
}

impl Allocation {
    pub fn end(&self) -> u64 {
        self.base + self.size
    }

    pub fn state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    pub fn is_live(&self) -> bool {
        self.state() == LIVE
    }

    /// The host address of the bytes at `addr` (inside the allocation).
    fn host_at(&self, addr: u64) -> *mut u8 {
        (self.host + (addr - self.base) as usize) as *mut u8
    }

    /// One line for reports.
    pub fn describe(&self) -> String {
        let state = match self.state() {
            LIVE => "live".to_string(),
            _ => lock(&self.note).clone(),
        };
        let place = match self.place {
            Place::Device(d) => format!("device {d}"),
            Place::Host => "pinned host memory".into(),
        };
        format!(
            "[{:#x}, {:#x}) ({} bytes, {place}, {state}, allocated by {})",
            self.base,
            self.end(),
            self.size,
            self.origin
        )
    }
}

struct Table {
    allocations: RwLock<BTreeMap<u64, Arc<Allocation>>>,
    cursor: Mutex<u64>,
    reserved: (u64, u64),
    used: Mutex<Vec<u64>>,
}

/// Bumped on every change that can turn a good access bad (free, deactivation, a new pending
/// write): the per-thread cache of the last allocation checked is valid while it is unchanged.
static GENERATION: AtomicU64 = AtomicU64::new(1);

fn bump() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

const GAP: u64 = 64 << 10;
const ALIGN: u64 = 512;
/// Fresh device memory is filled with this, so code that reads memory it never wrote sees
/// garbage here as it may on a GPU.
pub const POISON: u8 = 0xa5;

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut reserved = None;
        for tib in [16u64, 4, 1] {
            let len = (tib << 40) as usize;
            // SAFETY: reserves address space only (PROT_NONE, no backing); never unmapped.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                reserved = Some((p as u64, p as u64 + len as u64));
                break;
            }
        }
        let reserved = reserved.unwrap_or_else(|| {
            crate::diag::fatal("cannot reserve address space for device memory (mmap PROT_NONE)")
        });
        Table {
            allocations: RwLock::new(BTreeMap::new()),
            // Start 1 GiB in, so small integers cast to pointers are far from any allocation.
            cursor: Mutex::new(reserved.0 + (1 << 30)),
            reserved,
            used: Mutex::new(vec![0; config().devices.max(0) as usize]),
        }
    })
}

fn map_bytes(len: usize) -> Option<usize> {
    // SAFETY: a fresh private anonymous mapping; unmapped only by `release`.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as usize)
}

/// True when `addr` is in the device range (a device pointer, valid or not).
pub fn is_device_range(addr: u64) -> bool {
    let (lo, hi) = table().reserved;
    (lo..hi).contains(&addr)
}

/// Bytes allocated on `device` (for cuMemGetInfo and the out-of-memory check).
pub fn used(device: i32) -> u64 {
    lock(&table().used)
        .get(device as usize)
        .copied()
        .unwrap_or(0)
}

/// Allocates `size` bytes of device memory in state `state` (LIVE, or INACTIVE for
/// stream-ordered and graph allocations). Fails with CUDA_ERROR_OUT_OF_MEMORY past the device's
/// total memory.
pub fn alloc_device(
    device: i32,
    context: usize,
    size: u64,
    state: u8,
    origin: String,
    note: &str,
) -> CuResult<Arc<Allocation>> {
    allocate(device, context, size, state, origin, note, true)
}

/// A graph allocation (made at capture): its address is fixed now, its bytes count against the
/// device only once a launch reaches its allocation node ([`make_resident`]).
pub fn alloc_graph(
    device: i32,
    context: usize,
    size: u64,
    origin: String,
    note: &str,
) -> CuResult<Arc<Allocation>> {
    allocate(device, context, size, INACTIVE, origin, note, false)
}

fn allocate(
    device: i32,
    context: usize,
    size: u64,
    state: u8,
    origin: String,
    note: &str,
    counted: bool,
) -> CuResult<Arc<Allocation>> {
    let t = table();
    let charged = if counted { size } else { 0 };
    {
        let mut used = lock(&t.used);
        let slot = &mut used[device as usize];
        if slot.saturating_add(size) > config().memory_bytes {
            return err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        *slot += charged;
    }
    let base = {
        let mut cursor = lock(&t.cursor);
        let base = cursor.next_multiple_of(ALIGN);
        let next = base + size.next_multiple_of(ALIGN) + GAP;
        if next > t.reserved.1 {
            lock(&t.used)[device as usize] -= charged;
            return err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        *cursor = next;
        base
    };
    let Some(host) = map_bytes(size as usize) else {
        lock(&t.used)[device as usize] -= charged;
        return err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    };
    // SAFETY: `host` is a fresh writable mapping of at least `size` bytes.
    unsafe { std::ptr::write_bytes(host as *mut u8, POISON, size as usize) };
    let a = Arc::new(Allocation {
        base,
        size,
        place: Place::Device(device),
        context,
        origin,
        host,
        mapped_len: size as usize,
        state: AtomicU8::new(state),
        note: Mutex::new(note.to_string()),
        pending: Mutex::new(Vec::new()),
        peers: OnceLock::new(),
        counted: AtomicBool::new(counted),
    });
    t.allocations
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(base, a.clone());
    bump();
    Ok(a)
}

/// Allocates pinned host memory; its device address is its host address.
pub fn alloc_host(context: usize, size: u64, origin: String) -> CuResult<Arc<Allocation>> {
    let Some(host) = map_bytes(size as usize) else {
        return err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    };
    let a = Arc::new(Allocation {
        base: host as u64,
        size,
        place: Place::Host,
        context,
        origin,
        host,
        mapped_len: size as usize,
        state: AtomicU8::new(LIVE),
        note: Mutex::new(String::new()),
        pending: Mutex::new(Vec::new()),
        peers: OnceLock::new(),
        counted: AtomicBool::new(false),
    });
    table()
        .allocations
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(host as u64, a.clone());
    bump();
    Ok(a)
}

/// Moves an allocation between INACTIVE and LIVE (stream-ordered and graph allocations).
pub fn set_active(a: &Allocation, live: bool, note: &str) {
    if a.state() == FREED {
        return;
    }
    if !live {
        *lock(&a.note) = note.to_string();
    }
    a.state
        .store(if live { LIVE } else { INACTIVE }, Ordering::Release);
    bump();
}

/// Frees an allocation for good: its bytes are unmapped and any later use is reported as a use
/// after free naming `by`. Freeing twice is the caller's error to report (state is FREED).
pub fn release(a: &Allocation, by: &str) {
    if a.state.swap(FREED, Ordering::AcqRel) == FREED {
        return;
    }
    *lock(&a.note) = format!("freed by {by}");
    bump();
    if let Place::Device(d) = a.place {
        if a.counted.swap(false, Ordering::AcqRel) {
            lock(&table().used)[d as usize] -= a.size;
        }
    }
    // SAFETY: the mapping was made by map_bytes with this length and is unmapped once (the
    // state swap above guards it).
    unsafe { libc::munmap(a.host as *mut libc::c_void, a.mapped_len.max(1)) };
    // Pinned host memory is at its host address: drop the entry so that a later mmap reusing
    // the address is not mistaken for it.
    if a.place == Place::Host {
        table()
            .allocations
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&a.base);
    }
}

/// A launch reached a graph allocation's node: its bytes count against the device again if a
/// trim had given them back.
pub fn make_resident(a: &Allocation) {
    if let Place::Device(d) = a.place {
        if !a.counted.swap(true, Ordering::AcqRel) {
            lock(&table().used)[d as usize] += a.size;
        }
    }
}

/// Gives a graph allocation's bytes back to the device if no launch uses it now (it is past
/// its free node or before its allocation node). True when it did.
pub fn evict(a: &Allocation) -> bool {
    if a.state() != INACTIVE {
        return false;
    }
    match a.place {
        Place::Device(d) if a.counted.swap(false, Ordering::AcqRel) => {
            lock(&table().used)[d as usize] -= a.size;
            true
        }
        _ => false,
    }
}

/// Whether a graph allocation's bytes count against its device now.
pub fn is_resident(a: &Allocation) -> bool {
    a.counted.load(Ordering::Acquire)
}

/// Makes an allocation accessible from other devices only as `grants` (a bit per device) says.
pub fn restrict_peers(a: &Allocation, grants: Arc<AtomicU64>) {
    let _ = a.peers.set(grants);
}

/// Why device `device` may not access `addr` directly, if it may not: device memory of another
/// device from a stream-ordered pool (or a graph) that was not granted to it.
pub fn peer_denied(addr: u64, device: i32) -> Option<String> {
    let a = find(addr)?;
    let Place::Device(owner) = a.place else {
        return None;
    };
    let grants = a.peers.get()?;
    if owner == device || grants.load(Ordering::Acquire) & (1u64 << (device as u64 & 63)) != 0 {
        return None;
    }
    Some(format!(
        "{} comes from a stream-ordered memory pool of device {owner} that device {device} was not granted access to (cuMemPoolSetAccess); on a GPU this access faults",
        a.describe()
    ))
}

/// The allocation containing `addr`, in any state.
pub fn find(addr: u64) -> Option<Arc<Allocation>> {
    let map = table()
        .allocations
        .read()
        .unwrap_or_else(|p| p.into_inner());
    map.range(..=addr)
        .next_back()
        .filter(|(_, a)| addr < a.base + a.size.max(1))
        .map(|(_, a)| a.clone())
}

/// The allocation whose range is nearest to `addr` (for reports).
pub fn nearest(addr: u64) -> Option<Arc<Allocation>> {
    let map = table()
        .allocations
        .read()
        .unwrap_or_else(|p| p.into_inner());
    let below = map.range(..=addr).next_back().map(|(_, a)| a.clone());
    let above = map
        .range(addr.saturating_add(1)..)
        .next()
        .map(|(_, a)| a.clone());
    match (below, above) {
        (Some(b), Some(a)) => {
            if addr.saturating_sub(b.end()) <= a.base - addr {
                Some(b)
            } else {
                Some(a)
            }
        }
        (b, a) => b.or(a),
    }
}

/// Every allocation of a context that is not freed (for leak reports).
pub fn unfreed_in_context(context: usize) -> Vec<Arc<Allocation>> {
    let map = table()
        .allocations
        .read()
        .unwrap_or_else(|p| p.into_inner());
    map.values()
        .filter(|a| a.context == context && a.state() != FREED)
        .cloned()
        .collect()
}

/// Why an access was refused.
pub enum Fault {
    /// No allocation holds the address.
    Unallocated,
    /// The range runs past the end of (or starts before) the allocation.
    OutOfBounds(Arc<Allocation>),
    /// The allocation is freed or not (yet) live.
    NotLive(Arc<Allocation>),
    /// The allocation is on another device than the accessing work.
    WrongDevice(Arc<Allocation>, i32),
    /// A synchronous pageable copy is still writing the range.
    PendingWrite(Arc<Allocation>, PendingWrite),
}

impl Fault {
    /// The report: what accessed what, and the nearest allocation.
    pub fn describe(&self, who: &str, addr: u64, len: u64, write: bool) -> String {
        let mut s = format!(
            "{who}: {} of {len} bytes at {addr:#x}: ",
            if write { "write" } else { "read" }
        );
        let nearest = match self {
            Fault::Unallocated => {
                s.push_str("no allocation holds this address");
                if !is_device_range(addr) {
                    s.push_str(" (it is not a device pointer: pageable host memory cannot be used by device work; use cuMemHostAlloc/cudaMallocHost)");
                }
                nearest(addr)
            }
            Fault::OutOfBounds(a) => {
                let _ = write!(
                    s,
                    "out of bounds: the range ends {} bytes past the allocation",
                    (addr + len).saturating_sub(a.end())
                );
                Some(a.clone())
            }
            Fault::NotLive(a) => {
                let state = if a.state() == FREED {
                    "use after free"
                } else {
                    "use outside the allocation's lifetime in stream order"
                };
                let _ = write!(s, "{state} ({})", lock(&a.note));
                Some(a.clone())
            }
            Fault::WrongDevice(a, device) => {
                let _ = write!(
                    s,
                    "the memory is not on device {device}, the device of the work that accesses it"
                );
                Some(a.clone())
            }
            Fault::PendingWrite(a, w) => {
                let _ = write!(
                    s,
                    "{} memory that a synchronous cuMemcpyHtoD from pageable memory on the legacy stream has not finished writing ([{:#x}, {:#x}), {}); order the copy with the stream (cuMemcpyHtoDAsync on it, or synchronize)",
                    if write { "writes" } else { "reads" },
                    w.start,
                    w.end,
                    w.what
                );
                Some(a.clone())
            }
        };
        match nearest {
            Some(a) => {
                let _ = write!(s, "; nearest allocation {}", a.describe());
            }
            None => s.push_str("; no allocations exist"),
        }
        s
    }
}

#[derive(Clone, Copy)]
struct Cached {
    generation: u64,
    base: u64,
    end: u64,
    host: usize,
    device: Option<i32>,
}

thread_local! {
    static LAST: Cell<Option<Cached>> = const { Cell::new(None) };
}

/// Checks that `[addr, addr + len)` lies in one live allocation (on `device` when given; pinned
/// host memory is accessible from every device) that no pending pageable write overlaps, and
/// returns the host address of its bytes. `len` must be > 0.
pub fn translate(addr: u64, len: u64, device: Option<i32>) -> Result<*mut u8, Fault> {
    let generation = GENERATION.load(Ordering::Acquire);
    if let Some(c) = LAST.get() {
        if c.generation == generation
            && c.device == device
            && addr >= c.base
            && addr.checked_add(len).is_some_and(|e| e <= c.end)
        {
            return Ok((c.host + (addr - c.base) as usize) as *mut u8);
        }
    }
    let a = find(addr).ok_or(Fault::Unallocated)?;
    if addr.checked_add(len).map_or(true, |e| e > a.end()) {
        return Err(Fault::OutOfBounds(a));
    }
    if !a.is_live() {
        return Err(Fault::NotLive(a));
    }
    if let (Some(d), Place::Device(on)) = (device, a.place) {
        if d != on {
            return Err(Fault::WrongDevice(a, d));
        }
    }
    {
        let pending = lock(&a.pending);
        if let Some(w) = pending
            .iter()
            .find(|w| w.start < addr + len && addr < w.end)
        {
            return Err(Fault::PendingWrite(a.clone(), w.clone()));
        }
        if pending.is_empty() {
            LAST.set(Some(Cached {
                generation,
                base: a.base,
                end: a.end(),
                host: a.host,
                device,
            }));
        }
    }
    Ok(a.host_at(addr))
}

/// Registers a pending pageable write on `[addr, addr + len)` (already checked live).
pub fn add_pending(a: &Allocation, write: PendingWrite) {
    lock(&a.pending).push(write);
    bump();
}

/// Performs a pending write: copies `bytes` into the allocation (it must still be live) and
/// removes the pending entry. Returns false when the allocation died meanwhile.
pub fn complete_pending(a: &Allocation, id: u64, start: u64, bytes: &[u8]) -> bool {
    let ok = a.is_live();
    if ok {
        // SAFETY: the range was checked inside the live allocation when the write was queued;
        // the allocation is still live, so the mapping is present.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), a.host_at(start), bytes.len());
        }
    }
    lock(&a.pending).retain(|w| w.id != id);
    bump();
    ok
}

static NEXT_WRITE: AtomicU64 = AtomicU64::new(1);

/// A new pending-write id.
pub fn next_write_id() -> u64 {
    NEXT_WRITE.fetch_add(1, Ordering::Relaxed)
}
