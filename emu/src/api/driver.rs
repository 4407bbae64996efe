//! The CUDA driver API entry points (signatures from cuda.h, types from cudarc's `sys`). Each
//! converts arguments, calls the emulated machine and converts the result; enum arguments are
//! taken as their integer values so an unknown value is an error, not undefined behavior.

use crate::capture;
use crate::context::{self, Context};
use crate::device;
use crate::diag;
use crate::errors::{self, err, not_supported, CuError, CuResult};
use crate::event;
use crate::graph;
use crate::handles::lock;
use crate::kernel;
use crate::memory::{self, Place, FREED, LIVE};
use crate::module;
use crate::pool;
use crate::stream::{self, Work};
use crate::transfer::{self, Endpoint};
use cudarc::driver::sys::{
    CUcontext, CUctxCreateParams, CUdevice, CUdeviceptr, CUevent, CUfunction,
    CUfunction_attribute as FA, CUgraph, CUgraphExec, CUgraphMem_attribute, CUgraphNode, CUhostFn,
    CUmemAccessDesc, CUmemAccess_flags, CUmemLocation, CUmemPoolProps, CUmemoryPool, CUmodule,
    CUpointer_attribute as PA, CUresult, CUstream,
};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Arc;

/// Runs a driver export: a result code out, panics reported.
pub fn cu(name: &str, body: impl FnOnce() -> CuResult<()>) -> CUresult {
    diag::boundary(name, || match body() {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(e) => e.0,
    })
}

/// Like [`cu`] for calls that need cuInit first.
fn cu_init(name: &str, body: impl FnOnce() -> CuResult<()>) -> CUresult {
    cu(name, || {
        context::require_init()?;
        body()
    })
}

/// Writes an output argument, CUDA_ERROR_INVALID_VALUE when it is NULL.
pub unsafe fn put<T>(ptr: *mut T, value: T) -> CuResult<()> {
    if ptr.is_null() {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-NULL, and the caller's contract says it points at a writable T.
    ptr.write(value);
    Ok(())
}

// ---- initialization, version, devices, errors ----

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    cu("cuInit", || {
        if flags != 0 {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        context::init();
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    cu("cuDriverGetVersion", || {
        put(version, crate::config::config().driver_version)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    cu_init("cuDeviceGet", || put(device, device::check(ordinal)?))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    cu_init("cuDeviceGetCount", || {
        put(count, crate::config::config().devices)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    cu_init("cuDeviceGetName", || {
        device::check(dev)?;
        if name.is_null() || len <= 0 {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let text = device::name(dev);
        let n = text.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, n);
        *name.add(n) = 0;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    cu_init("cuDeviceTotalMem_v2", || {
        device::check(dev)?;
        put(bytes, crate::config::config().memory_bytes as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_uint,
    dev: CUdevice,
) -> CUresult {
    cu_init("cuDeviceGetAttribute", || {
        put(value, device::attribute(attrib, dev)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: c_uint, text: *mut *const c_char) -> CUresult {
    cu("cuGetErrorString", || match errors::driver_text(error) {
        Some(t) => put(text, t),
        None => {
            let _ = put(text, std::ptr::null());
            err(CUresult::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: c_uint, text: *mut *const c_char) -> CUresult {
    cu("cuGetErrorName", || match errors::driver_name(error) {
        Some(t) => put(text, t),
        None => {
            let _ = put(text, std::ptr::null());
            err(CUresult::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

// ---- contexts ----

fn ctx_handle(c: &Context) -> CUcontext {
    c.handle as CUcontext
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    cu_init("cuDevicePrimaryCtxRetain", || {
        if pctx.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        put(pctx, ctx_handle(&*context::retain_primary(dev)?))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    cu_init("cuDevicePrimaryCtxRelease_v2", || {
        context::release_primary(dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    cu_init("cuDevicePrimaryCtxReset_v2", || context::reset_primary(dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    cu_init("cuDevicePrimaryCtxGetState", || {
        let (_, on) = context::primary_state(dev)?;
        put(flags, 0)?;
        put(active, on as c_int)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    cu_init("cuCtxCreate_v2", || {
        if pctx.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if flags & !0x1f != 0 {
            return Err(not_supported(format_args!("cuCtxCreate flags {flags:#x}")));
        }
        put(pctx, ctx_handle(&*context::create(dev)?))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *mut CUctxCreateParams,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    diag::boundary("cuCtxCreate_v4", || {
        if !params.is_null() {
            let p = &*params;
            if !p.execAffinityParams.is_null()
                || p.numExecAffinityParams != 0
                || !p.cigParams.is_null()
            {
                return cu("cuCtxCreate_v4", || {
                    Err(not_supported(
                        "cuCtxCreate_v4 with execution affinity or CIG parameters",
                    ))
                });
            }
        }
        cuCtxCreate_v2(pctx, flags, dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    cu_init("cuCtxDestroy_v2", || context::destroy(ctx as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    cu_init("cuCtxPushCurrent_v2", || {
        context::get(ctx as usize)?;
        context::push(ctx as usize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    cu_init("cuCtxPopCurrent_v2", || match context::pop() {
        Some(h) => {
            if !pctx.is_null() {
                *pctx = h as CUcontext;
            }
            Ok(())
        }
        None => err(CUresult::CUDA_ERROR_INVALID_CONTEXT),
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    cu_init("cuCtxSetCurrent", || {
        if !ctx.is_null() {
            context::get(ctx as usize)?;
        }
        context::set_current(ctx as usize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    cu_init("cuCtxGetCurrent", || {
        put(pctx, context::current_handle() as CUcontext)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    cu_init("cuCtxGetDevice", || put(dev, context::current()?.device))
}

/// cuCtxSynchronize's body, shared with cudaDeviceSynchronize.
pub fn synchronize_context(ctx: &Context) -> CuResult<()> {
    capture::check_context_sync(ctx)?;
    ctx.synchronize();
    pool::on_synchronize(ctx.device);
    ctx.sticky_error()
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    cu_init("cuCtxSynchronize", || {
        synchronize_context(&*context::current()?)
    })
}

// ---- memory ----

/// cuMemAlloc's body, shared with cudaMalloc.
pub fn mem_alloc(ctx: &Context, bytes: usize, api: &str) -> CuResult<u64> {
    capture::check_unsafe_call(api)?;
    if bytes == 0 {
        return err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let a = memory::alloc_device(
        ctx.device,
        ctx.handle,
        bytes as u64,
        LIVE,
        format!("{api} ({bytes} bytes)"),
        "",
    )?;
    Ok(a.base)
}

/// cuMemFree's body: waits for the context's work (CUDA's implicit synchronization), then
/// frees. Freeing twice or a pointer that is not an allocation's start is a reported error.
pub fn mem_free(ptr: u64, api: &str, host: bool) -> CuResult<()> {
    capture::check_unsafe_call(api)?;
    if ptr == 0 {
        return Ok(());
    }
    let a = memory::find(ptr)
        .filter(|a| a.base == ptr && (a.place == Place::Host) == host)
        .ok_or_else(|| {
            let problem = match memory::find(ptr) {
                Some(a) => format!(
                    "not the start of an allocation of that kind; {}",
                    a.describe()
                ),
                None => "no allocation starts here".into(),
            };
            diag::strict(
                format!("{api}({ptr:#x}): {problem}"),
                CuError(CUresult::CUDA_ERROR_INVALID_VALUE),
            )
        })?;
    if a.state() == FREED {
        return Err(diag::strict(
            format!("{api}({ptr:#x}): double free; {}", a.describe()),
            CuError(CUresult::CUDA_ERROR_INVALID_VALUE),
        ));
    }
    if let Ok(c) = context::get(a.context) {
        c.synchronize();
    }
    memory::release(&a, api);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    cu_init("cuMemAlloc_v2", || {
        if dptr.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = context::current()?;
        put(dptr, mem_alloc(&ctx, bytes, "cuMemAlloc_v2")?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    cu_init("cuMemFree_v2", || {
        context::current()?;
        mem_free(dptr, "cuMemFree_v2", false)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    cu_init("cuMemGetInfo_v2", || {
        let ctx = context::current()?;
        let t = crate::config::config().memory_bytes;
        // What the pools keep for reuse is reserved, not free.
        let taken = memory::used(ctx.device).saturating_add(pool::cached_on(ctx.device));
        put(free, t.saturating_sub(taken) as usize)?;
        put(total, t as usize)
    })
}

/// cuMemHostAlloc's body, shared with cudaMallocHost.
pub fn host_alloc(ctx: &Context, bytes: usize, api: &str) -> CuResult<*mut c_void> {
    capture::check_unsafe_call(api)?;
    let a = memory::alloc_host(
        ctx.handle,
        bytes.max(1) as u64,
        format!("{api} ({bytes} bytes)"),
    )?;
    Ok(a.base as *mut c_void)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CUresult {
    cu_init("cuMemHostAlloc", || {
        if pp.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = context::current()?;
        put(pp, host_alloc(&ctx, bytes, "cuMemHostAlloc")?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    cuMemHostAlloc(pp, bytes, 0)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    cu_init("cuMemFreeHost", || {
        mem_free(p as u64, "cuMemFreeHost", true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    pdptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    cu_init("cuMemHostGetDevicePointer_v2", || {
        if flags != 0 {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        match memory::find(p as u64) {
            Some(a) if a.place == Place::Host && a.is_live() => put(pdptr, p as u64),
            _ => err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_uint,
    ptr: CUdeviceptr,
) -> CUresult {
    cu_init("cuPointerGetAttribute", || {
        if data.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Unregistered (pageable) host memory and freed memory are unknown to the driver.
        let a = memory::find(ptr)
            .filter(|a| a.state() != FREED)
            .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))?;
        let ctx = context::get(a.context)?;
        let is = |x: PA| attribute == x as u32;
        if is(PA::CU_POINTER_ATTRIBUTE_CONTEXT) {
            put(data.cast::<CUcontext>(), ctx_handle(&ctx))
        } else if is(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE) {
            put(
                data.cast::<c_uint>(),
                if a.place == Place::Host { 1 } else { 2 },
            )
        } else if is(PA::CU_POINTER_ATTRIBUTE_DEVICE_POINTER) {
            put(data.cast::<CUdeviceptr>(), ptr)
        } else if is(PA::CU_POINTER_ATTRIBUTE_HOST_POINTER) {
            if a.place == Place::Host {
                put(data.cast::<*mut c_void>(), ptr as *mut c_void)
            } else {
                err(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
        } else if is(PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) {
            put(data.cast::<c_int>(), ctx.device)
        } else if is(PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) {
            put(data.cast::<CUdeviceptr>(), a.base)
        } else if is(PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE) {
            put(data.cast::<usize>(), a.size as usize)
        } else if is(PA::CU_POINTER_ATTRIBUTE_IS_MANAGED) {
            put(data.cast::<c_uint>(), 0)
        } else {
            Err(not_supported(format_args!(
                "cuPointerGetAttribute(attribute {attribute})"
            )))
        }
    })
}

// ---- copies and memsets ----

fn check_endpoint(api: &str, what: &str, e: &Endpoint, bytes: u64) -> CuResult<()> {
    match e {
        Endpoint::Device(a) => transfer::check_range(api, what, *a, bytes),
        _ => Ok(()),
    }
}

fn is_pinned(addr: u64) -> bool {
    memory::find(addr).is_some_and(|a| a.place == Place::Host)
}

/// A synchronous copy (cuMemcpy*, cudaMemcpy): queued on the current context's legacy stream,
/// so it is ordered after the blocking streams' earlier work. From pageable host memory to the
/// device the call returns once the bytes are staged and the legacy stream has reached the copy;
/// the device write itself lands later (transfer::PageableWrite). Copies to or from host memory
/// return when done; device-to-device copies return at once, as CUDA documents.
pub unsafe fn memcpy_sync(
    api: &'static str,
    dst: Endpoint,
    src: Endpoint,
    bytes: u64,
) -> CuResult<()> {
    capture::check_unsafe_call(api)?;
    let ctx = context::current()?;
    check_endpoint(api, "dst", &dst, bytes)?;
    check_endpoint(api, "src", &src, bytes)?;
    if bytes == 0 {
        return Ok(());
    }
    capture::check_legacy_use(&ctx)?;
    let legacy = ctx.legacy_stream();
    match (&dst, &src) {
        (Endpoint::Device(d), Endpoint::Host(h)) => {
            let a = memory::find(*d).ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))?;
            // SAFETY: the caller's source holds `bytes` readable bytes (cuMemcpyHtoD contract).
            let staged = std::slice::from_raw_parts(*h as *const u8, bytes as usize).to_vec();
            let started = Arc::new(crate::completion::Completion::new());
            legacy.enqueue(
                Work::PageableWrite(Arc::new(transfer::PageableWrite {
                    alloc: a,
                    start: *d,
                    bytes: staged,
                    delay: crate::config::config().pageable_delay,
                    started: started.clone(),
                    api,
                })),
                Vec::new(),
            );
            started.wait();
        }
        (Endpoint::Device(d), Endpoint::Device(s)) if !is_pinned(*d) && !is_pinned(*s) => {
            legacy.enqueue(
                Work::Copy(Arc::new(transfer::Copy {
                    api,
                    dst,
                    src,
                    bytes,
                })),
                Vec::new(),
            );
        }
        _ => {
            legacy
                .enqueue(
                    Work::Copy(Arc::new(transfer::Copy {
                        api,
                        dst,
                        src,
                        bytes,
                    })),
                    Vec::new(),
                )
                .wait();
        }
    }
    ctx.sticky_error()
}

/// An asynchronous copy on `stream`. Pageable source bytes are staged at the call (as the
/// driver does); a copy into pageable host memory returns only when done (CUDA: it is
/// synchronous); pinned and device memory are read and written when the stream gets there.
pub unsafe fn memcpy_async(
    api: &'static str,
    dst: Endpoint,
    src: Endpoint,
    bytes: u64,
    stream: CUstream,
) -> CuResult<()> {
    let s = stream::resolve(stream as usize)?;
    check_endpoint(api, "dst", &dst, bytes)?;
    check_endpoint(api, "src", &src, bytes)?;
    let capturing = s.capture().is_some();
    let src = match src {
        // SAFETY: the caller's source holds `bytes` readable bytes.
        Endpoint::Host(h) if !capturing => Endpoint::Staged(Arc::new(
            std::slice::from_raw_parts(h as *const u8, bytes as usize).to_vec(),
        )),
        other => other,
    };
    let to_pageable = matches!(dst, Endpoint::Host(_));
    let work = Work::Copy(Arc::new(transfer::Copy {
        api,
        dst,
        src,
        bytes,
    }));
    if to_pageable && !capturing {
        if s.kind == stream::StreamKind::Legacy {
            capture::check_legacy_use(&s.context)?;
        }
        s.enqueue(work, Vec::new()).wait();
        return Ok(());
    }
    stream::submit(&s, work)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
) -> CUresult {
    cu_init("cuMemcpyHtoD_v2", || {
        memcpy_sync(
            "cuMemcpyHtoD_v2",
            Endpoint::Device(dst),
            transfer::classify(src as u64),
            bytes as u64,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
) -> CUresult {
    cu_init("cuMemcpyDtoH_v2", || {
        memcpy_sync(
            "cuMemcpyDtoH_v2",
            transfer::classify(dst as u64),
            Endpoint::Device(src),
            bytes as u64,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
) -> CUresult {
    cu_init("cuMemcpyDtoD_v2", || {
        memcpy_sync(
            "cuMemcpyDtoD_v2",
            Endpoint::Device(dst),
            Endpoint::Device(src),
            bytes as u64,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult {
    cu_init("cuMemcpy", || {
        memcpy_sync(
            "cuMemcpy",
            transfer::classify(dst),
            transfer::classify(src),
            bytes as u64,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    cu_init("cuMemcpyHtoDAsync_v2", || {
        memcpy_async(
            "cuMemcpyHtoDAsync_v2",
            Endpoint::Device(dst),
            transfer::classify(src as u64),
            bytes as u64,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    cu_init("cuMemcpyDtoHAsync_v2", || {
        memcpy_async(
            "cuMemcpyDtoHAsync_v2",
            transfer::classify(dst as u64),
            Endpoint::Device(src),
            bytes as u64,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    cu_init("cuMemcpyDtoDAsync_v2", || {
        memcpy_async(
            "cuMemcpyDtoDAsync_v2",
            Endpoint::Device(dst),
            Endpoint::Device(src),
            bytes as u64,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    cu_init("cuMemcpyAsync", || {
        memcpy_async(
            "cuMemcpyAsync",
            transfer::classify(dst),
            transfer::classify(src),
            bytes as u64,
            stream,
        )
    })
}

/// A memset; `stream` None is the synchronous form (legacy stream, returns at once as CUDA's
/// device memsets do).
pub fn memset(
    api: &'static str,
    dst: u64,
    value: u32,
    element: u64,
    count: u64,
    stream: Option<CUstream>,
) -> CuResult<()> {
    transfer::check_range(api, "dst", dst, element * count)?;
    let work = Work::Memset(Arc::new(transfer::Memset {
        api,
        dst,
        value,
        element,
        count,
    }));
    match stream {
        Some(s) => stream::submit(&stream::resolve(s as usize)?, work),
        None => {
            capture::check_unsafe_call(api)?;
            let ctx = context::current()?;
            capture::check_legacy_use(&ctx)?;
            ctx.legacy_stream().enqueue(work, Vec::new());
            ctx.sticky_error()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, count: usize) -> CUresult {
    cu_init("cuMemsetD8_v2", || {
        memset("cuMemsetD8_v2", dst, value as u32, 1, count as u64, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, value: c_uint, count: usize) -> CUresult {
    cu_init("cuMemsetD32_v2", || {
        memset("cuMemsetD32_v2", dst, value, 4, count as u64, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    value: u8,
    count: usize,
    stream: CUstream,
) -> CUresult {
    cu_init("cuMemsetD8Async", || {
        memset(
            "cuMemsetD8Async",
            dst,
            value as u32,
            1,
            count as u64,
            Some(stream),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(
    dst: CUdeviceptr,
    value: c_uint,
    count: usize,
    stream: CUstream,
) -> CUresult {
    cu_init("cuMemsetD32Async", || {
        memset(
            "cuMemsetD32Async",
            dst,
            value,
            4,
            count as u64,
            Some(stream),
        )
    })
}

// ---- streams ----

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) -> CUresult {
    cuStreamCreateWithPriority(ph, flags, 0)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ph: *mut CUstream,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    cu_init("cuStreamCreate", || {
        if ph.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // CUDA clamps a priority outside the range to it.
        let priority = priority.clamp(GREATEST_PRIORITY, LEAST_PRIORITY);
        put(ph, stream::create(flags, priority)?.handle as CUstream)
    })
}

/// Stream priorities as an H100/H200 reports them: 0 (the default) is the least, -5 the
/// greatest.
const LEAST_PRIORITY: c_int = 0;
const GREATEST_PRIORITY: c_int = -5;

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CUresult {
    cu_init("cuCtxGetStreamPriorityRange", || {
        context::current()?;
        if !least.is_null() {
            put(least, LEAST_PRIORITY)?;
        }
        if !greatest.is_null() {
            put(greatest, GREATEST_PRIORITY)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetPriority(h: CUstream, priority: *mut c_int) -> CUresult {
    cu_init("cuStreamGetPriority", || {
        let s = stream::resolve(h as usize)?;
        put(priority, s.priority)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(h: CUstream) -> CUresult {
    cu_init("cuStreamDestroy_v2", || stream::destroy(h as usize))
}

/// cuStreamSynchronize's body.
pub fn stream_synchronize(h: CUstream) -> CuResult<()> {
    let s = stream::resolve(h as usize)?;
    capture::check_stream_sync(&s)?;
    if s.kind == stream::StreamKind::Legacy {
        capture::check_legacy_use(&s.context)?;
    }
    s.wait_idle();
    pool::on_synchronize(s.context.device);
    s.context.sticky_error()
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(h: CUstream) -> CUresult {
    cu_init("cuStreamSynchronize", || stream_synchronize(h))
}

/// cuStreamQuery's body.
pub fn stream_query(h: CUstream) -> CuResult<()> {
    let s = stream::resolve(h as usize)?;
    capture::check_stream_sync(&s)?;
    s.context.sticky_error()?;
    if s.is_idle() {
        Ok(())
    } else {
        err(CUresult::CUDA_ERROR_NOT_READY)
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(h: CUstream) -> CUresult {
    cu_init("cuStreamQuery", || stream_query(h))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(h: CUstream, ev: CUevent, flags: c_uint) -> CUresult {
    cu_init("cuStreamWaitEvent", || {
        if flags != 0 {
            return Err(not_supported(format_args!(
                "cuStreamWaitEvent flags {flags:#x}"
            )));
        }
        event::wait(h as usize, &event::get(ev as usize)?)
    })
}

/// A stream memory operation's word: 4-byte aligned, and (now) inside an allocation that is not
/// freed; whether the stream's device may access it is checked when the work runs.
fn check_word(api: &str, addr: CUdeviceptr) -> CuResult<()> {
    if addr % 4 != 0 {
        return Err(diag::strict(
            format!("{api}: address {addr:#x} is not 4-byte aligned"),
            CuError(CUresult::CUDA_ERROR_INVALID_VALUE),
        ));
    }
    transfer::check_range(api, "addr", addr, 4)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitValue32_v2(
    h: CUstream,
    addr: CUdeviceptr,
    value: c_uint,
    flags: c_uint,
) -> CUresult {
    cu_init("cuStreamWaitValue32_v2", || {
        let s = stream::resolve(h as usize)?;
        if flags & crate::memop::WAIT_FLUSH != 0 {
            return Err(not_supported(
                "cuStreamWaitValue32_v2 with CU_STREAM_WAIT_VALUE_FLUSH (the emulated devices report CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES = 0)",
            ));
        }
        let condition = crate::memop::Condition::from_flags(flags)
            .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_VALUE))?;
        check_word("cuStreamWaitValue32_v2", addr)?;
        stream::submit(
            &s,
            Work::WaitValue(Arc::new(crate::memop::WaitValue {
                api: "cuStreamWaitValue32_v2",
                addr,
                value,
                condition,
            })),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWriteValue32_v2(
    h: CUstream,
    addr: CUdeviceptr,
    value: c_uint,
    flags: c_uint,
) -> CUresult {
    cu_init("cuStreamWriteValue32_v2", || {
        let s = stream::resolve(h as usize)?;
        if flags & !crate::memop::WRITE_NO_MEMORY_BARRIER != 0 {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        check_word("cuStreamWriteValue32_v2", addr)?;
        stream::submit(
            &s,
            Work::WriteValue(Arc::new(crate::memop::WriteValue {
                api: "cuStreamWriteValue32_v2",
                addr,
                value,
            })),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetFlags(h: CUstream, flags: *mut c_uint) -> CUresult {
    cu_init("cuStreamGetFlags", || {
        put(flags, stream::resolve(h as usize)?.flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(h: CUstream, pctx: *mut CUcontext) -> CUresult {
    cu_init("cuStreamGetCtx", || {
        put(pctx, ctx_handle(&stream::resolve(h as usize)?.context))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(
    h: CUstream,
    func: CUhostFn,
    data: *mut c_void,
) -> CUresult {
    cu_init("cuLaunchHostFunc", || {
        let Some(func) = func else {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        stream::submit(
            &stream::resolve(h as usize)?,
            Work::HostFunc {
                func,
                data: data as usize,
            },
        )
    })
}

// ---- events ----

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ph: *mut CUevent, flags: c_uint) -> CUresult {
    cu_init("cuEventCreate", || {
        if ph.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        put(ph, event::create(flags)?.handle as CUevent)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(ev: CUevent, h: CUstream) -> CUresult {
    cu_init("cuEventRecord", || {
        event::record(&event::get(ev as usize)?, h as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    ev: CUevent,
    h: CUstream,
    flags: c_uint,
) -> CUresult {
    diag::boundary("cuEventRecordWithFlags", || {
        if flags != 0 {
            return cu("cuEventRecordWithFlags", || {
                Err(not_supported(format_args!(
                    "cuEventRecordWithFlags flags {flags:#x}"
                )))
            });
        }
        cuEventRecord(ev, h)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(ev: CUevent) -> CUresult {
    cu_init("cuEventQuery", || event::query(&*event::get(ev as usize)?))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(ev: CUevent) -> CUresult {
    cu_init("cuEventSynchronize", || {
        event::synchronize(&*event::get(ev as usize)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    cu_init("cuEventElapsedTime", || {
        if ms.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        put(
            ms,
            event::elapsed(&*event::get(start as usize)?, &*event::get(end as usize)?)?,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(ev: CUevent) -> CUresult {
    cu_init("cuEventDestroy_v2", || event::destroy(ev as usize))
}

// ---- capture and graphs ----

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(h: CUstream, mode: c_uint) -> CUresult {
    cu_init("cuStreamBeginCapture_v2", || {
        capture::begin(&stream::resolve(h as usize)?, mode)
    })
}

/// cuStreamEndCapture's body: a graph handle (NULL when the capture failed).
pub fn end_capture(h: CUstream) -> (CuResult<()>, CUgraph) {
    let s = match stream::resolve(h as usize) {
        Ok(s) => s,
        Err(e) => return (Err(e), std::ptr::null_mut()),
    };
    match capture::end(&s) {
        Ok(nodes) => (Ok(()), graph::create(nodes).handle as CUgraph),
        Err(e) => (Err(e), std::ptr::null_mut()),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(h: CUstream, graph: *mut CUgraph) -> CUresult {
    cu_init("cuStreamEndCapture", || {
        if graph.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (result, g) = end_capture(h);
        *graph = g;
        result
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(h: CUstream, status: *mut c_uint) -> CUresult {
    cu_init("cuStreamIsCapturing", || {
        let s = stream::resolve(h as usize)?;
        put(status, capture::status(&s).0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    h: CUstream,
    status: *mut c_uint,
    id: *mut u64,
) -> CUresult {
    cu_init("cuStreamGetCaptureInfo", || {
        let s = stream::resolve(h as usize)?;
        let (st, cid) = capture::status(&s);
        put(status, st)?;
        if !id.is_null() {
            *id = cid;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    h: CUstream,
    status: *mut c_uint,
    id: *mut u64,
    graph: *mut CUgraph,
    deps: *mut *const CUgraphNode,
    ndeps: *mut usize,
) -> CUresult {
    diag::boundary("cuStreamGetCaptureInfo_v2", || {
        if !graph.is_null() || !deps.is_null() || !ndeps.is_null() {
            return cu("cuStreamGetCaptureInfo_v2", || {
                Err(not_supported(
                    "cuStreamGetCaptureInfo's graph and dependency outputs",
                ))
            });
        }
        cuStreamGetCaptureInfo(h, status, id)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3(
    h: CUstream,
    status: *mut c_uint,
    id: *mut u64,
    graph: *mut CUgraph,
    deps: *mut *const CUgraphNode,
    edges: *mut *const c_void,
    ndeps: *mut usize,
) -> CUresult {
    diag::boundary("cuStreamGetCaptureInfo_v3", || {
        if !edges.is_null() {
            return cu("cuStreamGetCaptureInfo_v3", || {
                Err(not_supported("cuStreamGetCaptureInfo's edge data output"))
            });
        }
        cuStreamGetCaptureInfo_v2(h, status, id, graph, deps, ndeps)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CUresult {
    cu_init("cuThreadExchangeStreamCaptureMode", || {
        if mode.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        *mode = capture::exchange_mode(*mode)?;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut CUgraphExec,
    g: CUgraph,
    flags: u64,
) -> CUresult {
    cu_init("cuGraphInstantiateWithFlags", || {
        if flags != 0 {
            return Err(not_supported(format_args!(
                "cuGraphInstantiateWithFlags flags {flags:#x}"
            )));
        }
        put(
            exec,
            graph::instantiate(&*graph::get(g as usize)?).handle as CUgraphExec,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    exec: *mut CUgraphExec,
    g: CUgraph,
    error_node: *mut CUgraphNode,
    log: *mut c_char,
    log_size: usize,
) -> CUresult {
    diag::boundary("cuGraphInstantiate_v2", || {
        if !error_node.is_null() {
            *error_node = std::ptr::null_mut();
        }
        if !log.is_null() && log_size > 0 {
            *log = 0;
        }
        cuGraphInstantiateWithFlags(exec, g, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(exec: CUgraphExec, h: CUstream) -> CUresult {
    cu_init("cuGraphLaunch", || {
        graph::launch(
            &graph::get_exec(exec as usize)?,
            &stream::resolve(h as usize)?,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(g: CUgraph) -> CUresult {
    cu_init("cuGraphDestroy", || graph::destroy(g as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult {
    cu_init("cuGraphExecDestroy", || graph::destroy_exec(exec as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphGetNodes(
    g: CUgraph,
    nodes: *mut CUgraphNode,
    count: *mut usize,
) -> CUresult {
    cu_init("cuGraphGetNodes", || {
        if !nodes.is_null() {
            return Err(not_supported(
                "cuGraphGetNodes with a node array (only the count is)",
            ));
        }
        put(count, graph::node_count(&*graph::get(g as usize)?))
    })
}

// ---- stream-ordered memory ----

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    h: CUstream,
) -> CUresult {
    cu_init("cuMemAllocAsync", || {
        if dptr.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let s = stream::resolve(h as usize)?;
        let p = pool::default_pool(s.context.device)?;
        put(
            dptr,
            pool::alloc_async(&p, bytes as u64, &s, "cuMemAllocAsync")?,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    p: CUmemoryPool,
    h: CUstream,
) -> CUresult {
    cu_init("cuMemAllocFromPoolAsync", || {
        if dptr.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let s = stream::resolve(h as usize)?;
        let p = pool::get(p as usize)?;
        put(
            dptr,
            pool::alloc_async(&p, bytes as u64, &s, "cuMemAllocFromPoolAsync")?,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, h: CUstream) -> CUresult {
    cu_init("cuMemFreeAsync", || {
        pool::free_async(dptr, &stream::resolve(h as usize)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    p: *mut CUmemoryPool,
    dev: CUdevice,
) -> CUresult {
    cu_init("cuDeviceGetDefaultMemPool", || {
        put(p, pool::default_pool(dev)?.handle as CUmemoryPool)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(
    p: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> CUresult {
    cu_init("cuMemPoolCreate", || {
        if p.is_null() || props.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let props = &*props;
        // Only device-local pinned pools: allocType PINNED (1), location DEVICE (1).
        if props.allocType as u32 != 1 || props.location.type_ as u32 != 1 {
            return Err(not_supported(
                "cuMemPoolCreate for other than a device-local pinned pool",
            ));
        }
        put(p, pool::create(props.location.id)?.handle as CUmemoryPool)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(p: CUmemoryPool) -> CUresult {
    cu_init("cuMemPoolDestroy", || pool::destroy(p as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(p: CUmemoryPool, keep: usize) -> CUresult {
    cu_init("cuMemPoolTrimTo", || {
        pool::get(p as usize)?.trim(keep as u64);
        Ok(())
    })
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: u32 = 1;

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAccess(
    p: CUmemoryPool,
    map: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    cu_init("cuMemPoolSetAccess", || {
        if map.is_null() && count != 0 {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let pool = pool::get(p as usize)?;
        let descs = if count == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(map, count)
        };
        for d in descs {
            if d.location.type_ as u32 != LOCATION_DEVICE {
                return Err(not_supported(
                    "cuMemPoolSetAccess for a location other than a device",
                ));
            }
            pool.set_access(d.location.id, d.flags as u32)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAccess(
    flags: *mut CUmemAccess_flags,
    p: CUmemoryPool,
    location: *mut CUmemLocation,
) -> CUresult {
    cu_init("cuMemPoolGetAccess", || {
        if flags.is_null() || location.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let location = &*location;
        if location.type_ as u32 != LOCATION_DEVICE {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let access = pool::get(p as usize)?.access(location.id)?;
        // The two values CUDA documents for pools: none, read-write.
        put(
            flags,
            if access == 3 {
                CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            } else {
                CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can: *mut c_int,
    dev: CUdevice,
    peer: CUdevice,
) -> CUresult {
    cu_init("cuDeviceCanAccessPeer", || {
        device::check(dev)?;
        device::check(peer)?;
        // Every emulated pair is peer capable (an NVLink/NVSwitch node); a device is not its
        // own peer.
        put(can, c_int::from(dev != peer))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(dev: CUdevice) -> CUresult {
    cu_init("cuDeviceGraphMemTrim", || {
        device::check(dev)?;
        graph::trim(dev);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetGraphMemAttribute(
    dev: CUdevice,
    attr: CUgraphMem_attribute,
    value: *mut c_void,
) -> CUresult {
    cu_init("cuDeviceGetGraphMemAttribute", || {
        device::check(dev)?;
        let (used, reserved) = graph::memory_in_use(dev);
        let v = match attr {
            CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT => used,
            CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT => reserved,
            _ => {
                return Err(not_supported(
                    "cuDeviceGetGraphMemAttribute for the high watermarks",
                ))
            }
        };
        put(value.cast::<u64>(), v)
    })
}

/// Pool attributes: the reuse flags are ints; the byte counts are cuuint64_t.
fn int_attribute(attr: c_uint) -> bool {
    (1..=3).contains(&attr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    p: CUmemoryPool,
    attr: c_uint,
    value: *mut c_void,
) -> CUresult {
    cu_init("cuMemPoolSetAttribute", || {
        if value.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let v = if int_attribute(attr) {
            *value.cast::<c_int>() as u64
        } else {
            *value.cast::<u64>()
        };
        pool::get(p as usize)?.set_attribute(attr, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    p: CUmemoryPool,
    attr: c_uint,
    value: *mut c_void,
) -> CUresult {
    cu_init("cuMemPoolGetAttribute", || {
        if value.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let v = pool::get(p as usize)?.get_attribute(attr)?;
        if int_attribute(attr) {
            *value.cast::<c_int>() = v as c_int;
        } else {
            *value.cast::<u64>() = v;
        }
        Ok(())
    })
}

// ---- modules and kernels ----

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut CUmodule, image: *const c_void) -> CUresult {
    cu_init("cuModuleLoadData", || {
        if m.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        capture::check_unsafe_call("cuModuleLoadData")?;
        let ctx = context::current()?;
        let parsed = match module::parse_at(image.cast()) {
            Ok(i) => i,
            Err((code, why)) => {
                diag::report(format_args!("cuModuleLoadData: {why}"));
                return err(code);
            }
        };
        put(
            m,
            module::load(ctx.handle, parsed, "cuModuleLoadData")?.handle as CUmodule,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    m: *mut CUmodule,
    image: *const c_void,
    noptions: c_uint,
    _options: *mut c_uint,
    _values: *mut *mut c_void,
) -> CUresult {
    diag::boundary("cuModuleLoadDataEx", || {
        if noptions > 0 {
            diag::report(
                "cuModuleLoadDataEx: JIT options are ignored by the emulator (it runs no JIT)",
            );
        }
        cuModuleLoadData(m, image)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: CUmodule) -> CUresult {
    cu_init("cuModuleUnload", || {
        capture::check_unsafe_call("cuModuleUnload")?;
        module::unload(m as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    cu_init("cuModuleGetFunction", || {
        if f.is_null() || name.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_string_lossy();
        put(
            f,
            module::get_function(m as usize, &name)?.handle as CUfunction,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut c_int,
    attrib: c_uint,
    f: CUfunction,
) -> CUresult {
    cu_init("cuFuncGetAttribute", || {
        let f = module::get_function_handle(f as usize)?;
        let m = module::get_module(f.module)?;
        let is = |x: FA| attrib == x as u32;
        let binary = match m.image.kind {
            module::ImageKind::Cubin { sm, .. } => sm as c_int,
            module::ImageKind::Ptx { sm, .. } => sm as c_int,
        };
        let v = if is(FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK) {
            f.info.max_threads.unwrap_or(1024) as c_int
        } else if is(FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            || is(FA::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES)
            || is(FA::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
            || is(FA::CU_FUNC_ATTRIBUTE_CACHE_MODE_CA)
        {
            0
        } else if is(FA::CU_FUNC_ATTRIBUTE_PTX_VERSION) || is(FA::CU_FUNC_ATTRIBUTE_BINARY_VERSION)
        {
            binary
        } else if is(FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
            48 << 10
        } else {
            return Err(not_supported(format_args!(
                "cuFuncGetAttribute(attribute {attrib})"
            )));
        };
        put(value, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    h: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    cu_init("cuLaunchKernel", || {
        let func = module::get_function_handle(f as usize)?;
        module::get_module(func.module)?;
        let s = stream::resolve(h as usize)?;
        if func.context != s.context.handle {
            return err(CUresult::CUDA_ERROR_INVALID_HANDLE);
        }
        if !extra.is_null() {
            return Err(not_supported("cuLaunchKernel with `extra` parameters"));
        }
        let threads = bx as u64 * by as u64 * bz as u64;
        let bad_dims = [gx, gy, gz, bx, by, bz].contains(&0)
            || threads > 1024
            || bx > 1024
            || by > 1024
            || bz > 64
            || gx > i32::MAX as u32
            || gy > 65535
            || gz > 65535
            || shared > 48 << 10;
        if bad_dims || func.info.max_threads.is_some_and(|m| threads > m as u64) {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if !module::launchable(&func.info.name) {
            diag::fatal(format_args!(
                "cuLaunchKernel of {} on {}: the emulator runs only {} and {}",
                func.info.name,
                s.name(),
                module::RUNNABLE.join(", "),
                module::LOOPBACK_COPY
            ));
        }
        if params.is_null() {
            return err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Injected launch failures hit the library's kernels (the loopback stand-in's copies
        // stand for NCCL's, which the injection does not cover).
        if module::runnable(&func.info.name).is_some() && crate::faults::launch_fails(s.handle) {
            return err(CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
        }
        let launch = kernel::Launch::new(
            func,
            [gx, gy, gz],
            [bx, by, bz],
            params as *const *const c_void,
        );
        stream::submit(&s, Work::Kernel(Arc::new(launch)))
    })
}

/// The sticky error of the current context, if any (for cudart's error reporting).
pub fn current_sticky() -> Option<CUresult> {
    context::current().ok().and_then(|c| *lock(&c.sticky))
}

/// `cuGetExportTable`: NVIDIA's private interfaces between its own libraries. NVRTC looks it up
/// when a libcuda is loaded in the process and must be told there is none to use.
#[no_mangle]
pub unsafe extern "C" fn cuGetExportTable(
    table: *mut *const c_void,
    _id: *const c_void,
) -> CUresult {
    diag::boundary("cuGetExportTable", || {
        if !table.is_null() {
            *table = std::ptr::null();
        }
        CUresult::CUDA_ERROR_NOT_SUPPORTED
    })
}
