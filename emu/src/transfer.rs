//! Copies and memsets as stream work, and the deferred device write of a synchronous
//! `cuMemcpyHtoD` from pageable memory.

use crate::completion::Completion;
use crate::diag;
use crate::errors::{CuError, CuResult};
use crate::memory::{self, Allocation, PendingWrite, FREED};
use crate::stream::Exec;
use cudarc::driver::sys::CUresult;
use std::sync::Arc;
use std::time::Duration;

/// One side of a copy.
#[derive(Clone, Debug)]
pub enum Endpoint {
    /// Device memory or pinned host memory (in the allocation table), checked at each access.
    Device(u64),
    /// Pageable host memory, trusted like the real driver trusts it.
    Host(usize),
    /// Bytes copied out of pageable memory when the call was made.
    Staged(Arc<Vec<u8>>),
}

/// Classifies an address for unified copies: in the allocation table → Device, else pageable.
pub fn classify(addr: u64) -> Endpoint {
    if memory::find(addr).is_some() || memory::is_device_range(addr) {
        Endpoint::Device(addr)
    } else {
        Endpoint::Host(addr as usize)
    }
}

/// Checks at call time that a device range could be valid (an allocation, not freed, in
/// bounds); liveness in stream order and device are checked when the work runs. Returns
/// CUDA_ERROR_INVALID_VALUE in return mode.
pub fn check_range(api: &str, what: &str, addr: u64, len: u64) -> CuResult<()> {
    if len == 0 {
        return Ok(());
    }
    let fault = match memory::find(addr) {
        None => memory::Fault::Unallocated,
        Some(a) if addr.checked_add(len).map_or(true, |e| e > a.end()) => {
            memory::Fault::OutOfBounds(a)
        }
        Some(a) if a.state() == FREED => memory::Fault::NotLive(a),
        Some(_) => return Ok(()),
    };
    Err(diag::strict(
        fault.describe(
            &format!("{api} ({what})"),
            addr,
            len,
            what.starts_with("dst"),
        ),
        CuError(CUresult::CUDA_ERROR_INVALID_VALUE),
    ))
}

/// A memcpy in stream order.
pub struct Copy {
    pub api: &'static str,
    pub dst: Endpoint,
    pub src: Endpoint,
    pub bytes: u64,
}

/// The host address of an endpoint's bytes, checking device ones now.
fn resolve(e: &Endpoint, len: u64, write: bool, who: &dyn Fn() -> String) -> Option<*mut u8> {
    match e {
        Endpoint::Host(p) => Some(*p as *mut u8),
        Endpoint::Staged(bytes) => Some(bytes.as_ptr() as *mut u8),
        Endpoint::Device(addr) => match memory::translate(*addr, len, None) {
            Ok(p) => Some(p),
            Err(f) => {
                diag::strict(f.describe(&who(), *addr, len, write), ());
                None
            }
        },
    }
}

impl Copy {
    pub fn run(&self, exec: &Exec<'_>) {
        if self.bytes == 0 {
            return;
        }
        let who = || format!("{} on {}", self.api, exec.stream.name());
        let (Some(src), Some(dst)) = (
            resolve(&self.src, self.bytes, false, &who),
            resolve(&self.dst, self.bytes, true, &who),
        ) else {
            *crate::handles::lock(&exec.stream.context.sticky) =
                Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
            return;
        };
        // SAFETY: both ranges were checked (device) or are the caller's promise (pageable host
        // memory, as with the real driver); copy handles overlap.
        unsafe { std::ptr::copy(src, dst, self.bytes as usize) };
    }
}

/// A memset of `count` elements of `element` bytes (1, 2 or 4) in stream order.
pub struct Memset {
    pub api: &'static str,
    pub dst: u64,
    pub value: u32,
    pub element: u64,
    pub count: u64,
}

impl Memset {
    pub fn run(&self, exec: &Exec<'_>) {
        let len = self.count * self.element;
        if len == 0 {
            return;
        }
        let p = match memory::translate(self.dst, len, None) {
            Ok(p) => p,
            Err(f) => {
                let who = format!("{} on {}", self.api, exec.stream.name());
                diag::strict(f.describe(&who, self.dst, len, true), ());
                *crate::handles::lock(&exec.stream.context.sticky) =
                    Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
                return;
            }
        };
        let bytes = self.value.to_le_bytes();
        // SAFETY: `len` bytes at `p` were checked writable above.
        let out = unsafe { std::slice::from_raw_parts_mut(p, len as usize) };
        for chunk in out.chunks_exact_mut(self.element as usize) {
            chunk.copy_from_slice(&bytes[..self.element as usize]);
        }
    }
}

/// The device write of a synchronous `cuMemcpyHtoD` from pageable memory: the bytes were copied
/// when the call was made; the write is queued on the legacy stream and lands after
/// NCCL_RESHARD_EMU_PAGEABLE_DELAY_MS. Until then the range is a pending write: work that is not
/// ordered after it (non-blocking streams, other contexts) and touches it is a reported hazard.
pub struct PageableWrite {
    pub alloc: Arc<Allocation>,
    pub start: u64,
    pub bytes: Vec<u8>,
    pub delay: Duration,
    /// Completed when the write starts (the call returns then).
    pub started: Arc<Completion>,
    pub api: &'static str,
}

impl PageableWrite {
    pub fn run(&self) {
        let id = memory::next_write_id();
        memory::add_pending(
            &self.alloc,
            PendingWrite {
                id,
                start: self.start,
                end: self.start + self.bytes.len() as u64,
                what: format!("{} of {} bytes", self.api, self.bytes.len()),
            },
        );
        self.started.complete();
        std::thread::sleep(self.delay);
        if !memory::complete_pending(&self.alloc, id, self.start, &self.bytes) {
            diag::strict(
                format!(
                    "{}: the destination was freed before the copy from pageable memory finished writing it; nearest allocation {}",
                    self.api,
                    self.alloc.describe()
                ),
                (),
            );
        }
    }
}
