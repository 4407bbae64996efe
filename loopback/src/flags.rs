//! The flags of the rendezvous: one pool of pinned, portable, device-mapped host memory,
//! allocated once (at the first communicator's init) and kept for the process's life, cut into
//! slots of two 32-bit words, `ready` and `done`, one slot per matched send/receive pair.
//!
//! Why host memory: the host must be able to write the flags too (a revoke releases waits from
//! the host) and read them (a slot is given back once its pair is over; the watchdog says which
//! flag an operation waits for). Why allocated once: `cuMemHostAlloc` may synchronise the device
//! on a GPU, and while ranks' streams wait for flags a synchronisation would wait for them, and
//! they for the thread that makes it. Why never freed: a captured graph may replay its waits at
//! any time, and freeing pinned memory synchronises as well.

use crate::cuda::{driver, Context, DevicePtr};
use crate::report::{fail, lock, NResult, INTERNAL_ERROR};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

/// Slots in the pool (`NCCL_LOOPBACK_SLOTS`, default 65536: 512 KiB).
fn capacity() -> u32 {
    std::env::var("NCCL_LOOPBACK_SLOTS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1 << 16)
}

/// Slot words: `ready` at 8·i, `done` at 8·i + 4.
const SLOT_BYTES: usize = 8;

pub struct Pool {
    /// The pool's host address (for the host's reads and writes).
    host: usize,
    /// Its device address (for the streams' operations).
    device: DevicePtr,
    slots: u32,
    free: Mutex<Vec<u32>>,
}

/// The flag word of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Word {
    /// Written 1 by the rank that posted first when its stream reaches the group; the copying
    /// rank waits for it and writes 0 back.
    Ready,
    /// Written 1 by the copying rank once the copy is done; the first rank waits for it and
    /// writes it back: 0 in a graph (so the next replay waits again), [`RETIRED`] otherwise.
    Done,
}

/// `done` once the first rank's stream has passed the pair for good (not in a graph): nothing
/// touches the slot after that, so the host may give it back.
pub const RETIRED: u32 = 2;

static POOL: OnceLock<Result<Pool, String>> = OnceLock::new();

/// Allocates the pool in `ctx` if it is not there yet.
pub fn ensure(ctx: Context) -> NResult<&'static Pool> {
    let made = POOL.get_or_init(|| {
        let d = driver().map_err(|e| e.message)?;
        let slots = capacity();
        let bytes = slots as usize * SLOT_BYTES;
        let (host, device) = {
            let _current = d.push(ctx).map_err(|e| e.message)?;
            d.host_alloc(bytes).map_err(|e| e.message)?
        };
        // SAFETY: `bytes` fresh writable bytes, not yet shared with any device work.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        Ok(Pool {
            host,
            device,
            slots,
            free: Mutex::new((0..slots).rev().collect()),
        })
    });
    match made {
        Ok(p) => Ok(p),
        Err(e) => fail(INTERNAL_ERROR, format!("the flag pool: {e}")),
    }
}

/// The pool, once a communicator has made it.
pub fn pool() -> &'static Pool {
    match POOL.get() {
        Some(Ok(p)) => p,
        _ => unreachable!("operations exist only on communicators, whose init made the pool"),
    }
}

impl Pool {
    /// A free slot (both words 0), if any.
    pub fn take(&self) -> Option<u32> {
        lock(&self.free).pop()
    }

    /// Gives back a slot nothing will touch again, cleared.
    pub fn give(&self, slot: u32) {
        self.store(slot, Word::Ready, 0);
        self.store(slot, Word::Done, 0);
        lock(&self.free).push(slot);
    }

    pub fn capacity(&self) -> u32 {
        self.slots
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        lock(&self.free).len()
    }

    /// The word's offset in the pool.
    fn offset(&self, slot: u32, word: Word) -> usize {
        assert!(slot < self.slots, "slot {slot} outside the pool");
        slot as usize * SLOT_BYTES + if word == Word::Done { 4 } else { 0 }
    }

    /// The word's device address, for stream memory operations.
    pub fn address(&self, slot: u32, word: Word) -> DevicePtr {
        self.device + self.offset(slot, word) as u64
    }

    fn atomic(&self, slot: u32, word: Word) -> &AtomicU32 {
        // SAFETY: the address is inside the pool (asserted), 4-byte aligned (the pool is
        // page-aligned, words at multiples of 4), mapped for the process's life; devices write
        // it too, so every host access is atomic.
        unsafe { AtomicU32::from_ptr((self.host + self.offset(slot, word)) as *mut u32) }
    }

    /// What the word holds now.
    pub fn load(&self, slot: u32, word: Word) -> u32 {
        self.atomic(slot, word).load(Ordering::Acquire)
    }

    /// Writes the word from the host.
    pub fn store(&self, slot: u32, word: Word, value: u32) {
        self.atomic(slot, word).store(value, Ordering::Release);
    }
}
