//! Stream-ordered memory: pools, `cuMemAllocAsync` and `cuMemFreeAsync`.
//!
//! An allocation's address is handed out by the call, but the memory becomes usable only when
//! the stream reaches the allocation, and stops being usable when the stream reaches the free;
//! any access outside that window is a reported use-before-alloc or use-after-free. Addresses
//! are never reused, so reuse in stream order is trivially safe; the pool keeps CUDA's byte
//! accounting (used, reserved, high watermarks, release threshold, trimming). In a capture, the
//! allocation belongs to the graph and is live between its allocation and free nodes in each
//! replay.

use crate::errors::{err, not_supported, CuError, CuResult};
use crate::handles::{self, lock, Registry};
use crate::memory::{self, Allocation, INACTIVE};
use crate::stream::{Stream, Work};
use cudarc::driver::sys::{CUmemPool_attribute as Attr, CUresult};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Default)]
struct Accounts {
    used: u64,
    /// Freed bytes the pool keeps (reserved = used + cached).
    cached: u64,
    used_high: u64,
    reserved_high: u64,
    release_threshold: u64,
    reuse: [i32; 3],
    /// Live allocations by base address.
    live: HashMap<u64, Arc<Allocation>>,
}

pub struct Pool {
    pub handle: usize,
    pub device: i32,
    pub context: usize,
    pub default: bool,
    accounts: Mutex<Accounts>,
    /// The devices besides its own that may access its allocations (a bit per device:
    /// `cuMemPoolSetAccess`); a new pool grants none.
    grants: Arc<AtomicU64>,
}

fn pools() -> &'static Registry<Pool> {
    static R: OnceLock<Registry<Pool>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

fn defaults() -> &'static Mutex<HashMap<i32, Arc<Pool>>> {
    static D: OnceLock<Mutex<HashMap<i32, Arc<Pool>>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(HashMap::new()))
}

fn new_pool(device: i32, context: usize, default: bool) -> Arc<Pool> {
    let p = Arc::new(Pool {
        handle: handles::next(),
        device,
        context,
        default,
        accounts: Mutex::new(Accounts {
            reuse: [1, 1, 1],
            ..Default::default()
        }),
        grants: Arc::new(AtomicU64::new(0)),
    });
    pools().insert(p.handle, p.clone());
    p
}

/// `cuDeviceGetDefaultMemPool`.
pub fn default_pool(device: i32) -> CuResult<Arc<Pool>> {
    crate::device::check(device)?;
    let context = crate::context::primary(device)?.handle;
    Ok(lock(defaults())
        .entry(device)
        .or_insert_with(|| new_pool(device, context, true))
        .clone())
}

/// `cuMemPoolCreate` for a device-local pool.
pub fn create(device: i32) -> CuResult<Arc<Pool>> {
    crate::device::check(device)?;
    let context = crate::context::primary(device)?.handle;
    Ok(new_pool(device, context, false))
}

pub fn get(handle: usize) -> CuResult<Arc<Pool>> {
    pools()
        .get(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))
}

/// `cuMemPoolDestroy`: live allocations stay usable until freed (as in CUDA).
pub fn destroy(handle: usize) -> CuResult<()> {
    let p = get(handle)?;
    if p.default {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    pools().remove(handle);
    Ok(())
}

pub fn retire_context(context: usize) {
    lock(defaults()).retain(|_, p| p.context != context);
    for p in pools().all() {
        if p.context == context {
            pools().remove(p.handle);
        }
    }
}

impl Pool {
    fn trim_to(a: &mut Accounts, keep: u64) {
        a.cached = a.cached.min(keep.saturating_sub(a.used));
    }

    /// `cuMemPoolTrimTo`.
    pub fn trim(&self, keep: u64) {
        Self::trim_to(&mut lock(&self.accounts), keep);
    }

    /// At a synchronization, memory above the release threshold goes back to the system.
    pub fn on_synchronize(&self) {
        let mut a = lock(&self.accounts);
        let threshold = a.release_threshold;
        if a.used + a.cached > threshold {
            Self::trim_to(&mut a, threshold);
        }
    }

    pub fn get_attribute(&self, attr: u32) -> CuResult<u64> {
        let a = lock(&self.accounts);
        let is = |x: Attr| attr == x as u32;
        Ok(if is(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
            a.release_threshold
        } else if is(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) {
            a.used + a.cached
        } else if is(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) {
            a.reserved_high
        } else if is(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT) {
            a.used
        } else if is(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH) {
            a.used_high
        } else if (1..=3).contains(&attr) {
            a.reuse[attr as usize - 1] as u64
        } else {
            return Err(not_supported(format_args!(
                "cuMemPoolGetAttribute(attribute {attr})"
            )));
        })
    }

    /// `cuMemPoolSetAccess` for one device: `flags` 0 (none) or 3 (read and write; read-only
    /// is not emulated). The pool's own device always keeps read and write.
    pub fn set_access(&self, device: i32, flags: u32) -> CuResult<()> {
        crate::device::check(device)?;
        if device == self.device {
            if flags != 3 {
                return Err(crate::diag::strict(
                    format!(
                        "cuMemPoolSetAccess: device {device} owns the pool; its access cannot be changed"
                    ),
                    CuError(CUresult::CUDA_ERROR_INVALID_DEVICE),
                ));
            }
            return Ok(());
        }
        let bit = 1u64 << (device as u64 & 63);
        match flags {
            0 => self.grants.fetch_and(!bit, Ordering::AcqRel),
            3 => self.grants.fetch_or(bit, Ordering::AcqRel),
            other => {
                return Err(not_supported(format_args!(
                    "cuMemPoolSetAccess with flags {other} (only none and read-write)"
                )))
            }
        };
        Ok(())
    }

    /// `cuMemPoolGetAccess`: 3 for the pool's device and granted devices, else 0.
    pub fn access(&self, device: i32) -> CuResult<u32> {
        crate::device::check(device)?;
        let granted = self.grants.load(Ordering::Acquire) & (1u64 << (device as u64 & 63)) != 0;
        Ok(if device == self.device || granted {
            3
        } else {
            0
        })
    }

    /// `cuMemPoolSetAttribute`: the threshold, the reuse flags (accepted; addresses are never
    /// reused anyway) and resetting the high watermarks (value 0).
    pub fn set_attribute(&self, attr: u32, value: u64) -> CuResult<()> {
        let mut a = lock(&self.accounts);
        let is = |x: Attr| attr == x as u32;
        if is(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
            a.release_threshold = value;
        } else if (1..=3).contains(&attr) {
            a.reuse[attr as usize - 1] = value as i32;
        } else if is(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) && value == 0 {
            a.reserved_high = a.used + a.cached;
        } else if is(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH) && value == 0 {
            a.used_high = a.used;
        } else {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
}

/// Bytes the pools of `device` keep for reuse (reserved but not allocated): device memory
/// nobody else can use, so `cuMemGetInfo` does not count it as free.
pub fn cached_on(device: i32) -> u64 {
    pools()
        .all()
        .iter()
        .filter(|p| p.device == device)
        .map(|p| lock(&p.accounts).cached)
        .sum()
}

/// Pools whose accounts a synchronization of `device` trims.
pub fn on_synchronize(device: i32) {
    for p in pools().all() {
        if p.device == device {
            p.on_synchronize();
        }
    }
}

/// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` on `stream`.
pub fn alloc_async(pool: &Arc<Pool>, size: u64, stream: &Arc<Stream>, api: &str) -> CuResult<u64> {
    if size == 0 {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if stream.context.device != pool.device {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let capturing = stream.capture();
    let note = format!(
        "not yet allocated: its {api} on {} has not been reached in stream order{}",
        stream.name(),
        if capturing.is_some() {
            " (a graph allocation, live only between its allocation and free nodes of a launch)"
        } else {
            ""
        }
    );
    let origin = format!("{api} ({size} bytes) on {}", stream.name());
    let a = match capturing {
        Some(_) => memory::alloc_graph(pool.device, stream.context.handle, size, origin, &note)?,
        None => memory::alloc_device(
            pool.device,
            stream.context.handle,
            size,
            INACTIVE,
            origin,
            &note,
        )?,
    };
    memory::restrict_peers(&a, pool.grants.clone());
    if let Some(c) = capturing {
        crate::capture::record(&c, stream, Work::AllocReached(a.clone()))?;
        return Ok(a.base);
    }
    {
        let mut acc = lock(&pool.accounts);
        acc.used += size;
        acc.cached = acc.cached.saturating_sub(size);
        acc.used_high = acc.used_high.max(acc.used);
        acc.reserved_high = acc.reserved_high.max(acc.used + acc.cached);
        acc.live.insert(a.base, a.clone());
    }
    crate::stream::submit(stream, Work::AllocReached(a.clone()))?;
    Ok(a.base)
}

/// The stream reached a stream-ordered allocation (or a launch its graph's allocation node).
pub fn reached_alloc(a: &Allocation) {
    memory::make_resident(a);
    memory::set_active(a, true, "");
}

/// A free in stream order.
pub struct Freed {
    pub alloc: Arc<Allocation>,
    pub pool: Option<Arc<Pool>>,
    /// A graph's free node: the memory stays the graph's, inactive until the next launch.
    pub graph: bool,
    pub by: String,
}

impl Freed {
    pub fn run(&self) {
        if self.graph {
            memory::set_active(&self.alloc, false, &format!("freed by {}", self.by));
            return;
        }
        memory::release(&self.alloc, &self.by);
        if let Some(p) = &self.pool {
            let mut acc = lock(&p.accounts);
            acc.used -= self.alloc.size;
            acc.cached += self.alloc.size;
            acc.live.remove(&self.alloc.base);
        }
    }
}

/// The pool that handed out `base`, if any.
fn pool_of(base: u64) -> Option<Arc<Pool>> {
    pools()
        .all()
        .into_iter()
        .find(|p| lock(&p.accounts).live.contains_key(&base))
}

/// `cuMemFreeAsync`.
pub fn free_async(ptr: u64, stream: &Arc<Stream>) -> CuResult<()> {
    let Some(a) = memory::find(ptr).filter(|a| a.base == ptr) else {
        return Err(crate::diag::strict(
            format!("cuMemFreeAsync({ptr:#x}): not the start of an allocation"),
            CuError(CUresult::CUDA_ERROR_INVALID_VALUE),
        ));
    };
    if a.state() == memory::FREED {
        return Err(crate::diag::strict(
            format!("cuMemFreeAsync({ptr:#x}): double free; {}", a.describe()),
            CuError(CUresult::CUDA_ERROR_INVALID_VALUE),
        ));
    }
    let by = format!("cuMemFreeAsync on {}", stream.name());
    if let Some(c) = stream.capture() {
        let ours = pool_of(ptr).is_none() && a.state() == INACTIVE;
        if !ours {
            return Err(not_supported(
                "cuMemFreeAsync during capture of memory not allocated by the same capture",
            ));
        }
        return crate::capture::record(
            &c,
            stream,
            Work::FreeReached(Arc::new(Freed {
                alloc: a,
                pool: None,
                graph: true,
                by: "the graph's free node".into(),
            })),
        );
    }
    let pool = pool_of(ptr);
    crate::stream::submit(
        stream,
        Work::FreeReached(Arc::new(Freed {
            alloc: a,
            pool,
            graph: false,
            by,
        })),
    )
}
