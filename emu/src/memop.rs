//! Stream memory operations (`cuStreamWaitValue32_v2`, `cuStreamWriteValue32_v2`): a stream
//! that waits until a 32-bit word in memory meets a condition, and one that writes a word, each
//! in stream order like any other work (captured into graphs and replayed like it too).
//!
//! The word is in device memory of the stream's device or in pinned host memory, checked like
//! every other access when the work runs. A host thread may write pinned memory directly, so a
//! blocked wait re-reads the word on a short timer; it wakes at once when emulated stream work
//! writes a value. While it is blocked it is registered with the deadlock watchdog, which names
//! the address, the condition and the value the word holds when nothing else progresses.

use crate::diag;
use crate::handles::lock;
use crate::memory::{self, Allocation};
use crate::stream::Exec;
use cudarc::driver::sys::CUresult;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// `CU_STREAM_WAIT_VALUE_FLUSH`: needs `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES`, which the
/// emulated devices do not have.
pub const WAIT_FLUSH: u32 = 1 << 30;
/// `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`.
pub const WRITE_NO_MEMORY_BARRIER: u32 = 1;

/// The condition of a wait (`CUstreamWaitValue_flags`, low bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// `CU_STREAM_WAIT_VALUE_GEQ` (0): `(int32_t)(*addr - value) >= 0`, cyclic.
    Geq,
    /// `CU_STREAM_WAIT_VALUE_EQ` (1): `*addr == value`.
    Eq,
    /// `CU_STREAM_WAIT_VALUE_AND` (2): `(*addr & value) != 0`.
    And,
    /// `CU_STREAM_WAIT_VALUE_NOR` (3): `~(*addr | value) != 0`.
    Nor,
}

impl Condition {
    /// The condition of a flags word without `CU_STREAM_WAIT_VALUE_FLUSH`, if it names one.
    pub fn from_flags(flags: u32) -> Option<Condition> {
        match flags {
            0 => Some(Condition::Geq),
            1 => Some(Condition::Eq),
            2 => Some(Condition::And),
            3 => Some(Condition::Nor),
            _ => None,
        }
    }

    pub fn holds(self, word: u32, value: u32) -> bool {
        match self {
            Condition::Geq => (word.wrapping_sub(value) as i32) >= 0,
            Condition::Eq => word == value,
            Condition::And => word & value != 0,
            Condition::Nor => !(word | value) != 0,
        }
    }

    /// The condition as CUDA's documentation writes it, for reports.
    pub fn describe(self, addr: u64, value: u32) -> String {
        match self {
            Condition::Geq => format!("(int32_t)(*{addr:#x} - {value:#x}) >= 0 (GEQ)"),
            Condition::Eq => format!("*{addr:#x} == {value:#x} (EQ)"),
            Condition::And => format!("(*{addr:#x} & {value:#x}) != 0 (AND)"),
            Condition::Nor => format!("~(*{addr:#x} | {value:#x}) != 0 (NOR)"),
        }
    }
}

/// Wakes blocked waits when emulated stream work writes a value; host writes are seen on the
/// next poll.
fn written() -> &'static (Mutex<u64>, Condvar) {
    static WRITTEN: OnceLock<(Mutex<u64>, Condvar)> = OnceLock::new();
    WRITTEN.get_or_init(|| (Mutex::new(0), Condvar::new()))
}

/// How long a blocked wait sleeps at most before it reads the word again: host threads write
/// pinned memory without telling the emulator.
const POLL: Duration = Duration::from_millis(1);

/// The host address of the word at `addr`, checked in bounds of live memory the stream's
/// device may access, with its allocation. A fault is reported (strict) and becomes the
/// context's sticky error, as a faulting access on a GPU does.
fn word(api: &str, addr: u64, write: bool, exec: &Exec<'_>) -> Option<(usize, Arc<Allocation>)> {
    match memory::translate(addr, 4, Some(exec.device())) {
        Ok(p) => Some((
            p as usize,
            memory::find(addr).expect("a translated address is allocated"),
        )),
        Err(f) => {
            let who = format!("{api} on {}", exec.stream.name());
            diag::strict(f.describe(&who, addr, 4, write), ());
            *lock(&exec.stream.context.sticky) = Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
            None
        }
    }
}

/// The word at host address `at` as an atomic.
///
/// # Safety
/// `at` came from [`word`] and its allocation is still live (its bytes are mapped until it is
/// released). It is 4-byte aligned: the API checks the device address, and an allocation's
/// bytes start page-aligned, so the host address has the same alignment.
unsafe fn atomic<'a>(at: usize) -> &'a AtomicU32 {
    // SAFETY: per the function's contract.
    unsafe { AtomicU32::from_ptr(at as *mut u32) }
}

/// `cuStreamWaitValue32_v2` as stream work.
pub struct WaitValue {
    pub api: &'static str,
    pub addr: u64,
    pub value: u32,
    pub condition: Condition,
}

/// A wait that has found its condition false, for the watchdog.
pub struct Blocked {
    pub id: u64,
    pub stream: String,
    pub what: String,
    /// The word's host address.
    at: usize,
    alloc: Arc<Allocation>,
}

impl Blocked {
    /// One line for the deadlock report: what it waits for and what the word holds now.
    pub fn describe(&self) -> String {
        let now = if self.alloc.is_live() {
            // SAFETY: the word's allocation is live (checked just above; a report races with a
            // free only when the program frees memory a stream still waits on).
            format!("{:#x}", unsafe { atomic(self.at) }.load(Ordering::Acquire))
        } else {
            "(the memory was freed)".to_string()
        };
        format!(
            "{} waits in {}: the word holds {now}; it is in {}",
            self.stream,
            self.what,
            self.alloc.describe()
        )
    }
}

fn blocked() -> &'static Mutex<Vec<Arc<Blocked>>> {
    static BLOCKED: OnceLock<Mutex<Vec<Arc<Blocked>>>> = OnceLock::new();
    BLOCKED.get_or_init(|| Mutex::new(Vec::new()))
}

/// The waits blocked now (watchdog input).
pub fn blocked_waits() -> Vec<Arc<Blocked>> {
    lock(blocked()).clone()
}

/// Unregisters a blocked wait when it ends (satisfied, or its memory gone).
struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        lock(blocked()).retain(|b| b.id != self.0);
    }
}

impl WaitValue {
    pub fn run(&self, exec: &Exec<'_>) {
        let Some((at, alloc)) = word(self.api, self.addr, false, exec) else {
            return;
        };
        // SAFETY: `at` was just translated; its allocation is live.
        if self
            .condition
            .holds(unsafe { atomic(at) }.load(Ordering::Acquire), self.value)
        {
            return;
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        lock(blocked()).push(Arc::new(Blocked {
            id,
            stream: exec.stream.name(),
            what: format!(
                "{} until {}",
                self.api,
                self.condition.describe(self.addr, self.value)
            ),
            at,
            alloc: alloc.clone(),
        }));
        let _registered = Registration(id);
        crate::watchdog::start();
        let (lock_, cv) = written();
        let mut seen = *lock(lock_);
        loop {
            if !alloc.is_live() {
                let who = format!("{} on {}", self.api, exec.stream.name());
                diag::strict(
                    format!(
                        "{who}: the memory it waits on was freed while the stream waited ({})",
                        alloc.describe()
                    ),
                    (),
                );
                *lock(&exec.stream.context.sticky) = Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
                return;
            }
            // SAFETY: the allocation was live just above.
            if self
                .condition
                .holds(unsafe { atomic(at) }.load(Ordering::Acquire), self.value)
            {
                return;
            }
            let guard = lock(lock_);
            if *guard == seen {
                let (guard, _) = cv
                    .wait_timeout(guard, POLL)
                    .unwrap_or_else(|p| p.into_inner());
                seen = *guard;
            } else {
                seen = *guard;
            }
        }
    }
}

/// `cuStreamWriteValue32_v2` as stream work. Every write is a full fence here: the emulator
/// does not model the reordering `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` permits.
pub struct WriteValue {
    pub api: &'static str,
    pub addr: u64,
    pub value: u32,
}

impl WriteValue {
    pub fn run(&self, exec: &Exec<'_>) {
        let Some((at, _alloc)) = word(self.api, self.addr, true, exec) else {
            return;
        };
        // SAFETY: `at` was just translated; its allocation is live.
        unsafe { atomic(at) }.store(self.value, Ordering::SeqCst);
        let (lock_, cv) = written();
        *lock(lock_) += 1;
        cv.notify_all();
    }
}
