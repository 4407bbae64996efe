//! The CUDA runtime subset, over the same emulated machine as the driver API. As in cudart,
//! each thread has a current device (`cudaSetDevice`, default 0); runtime calls use the current
//! driver context when there is one, else that device's primary context, retained implicitly at
//! first use and made current. Errors are `cudaError_t` codes, also kept as the thread's last
//! error (`cudaGetLastError`); a kernel fault's error is sticky.

use super::driver::{self, put};
use crate::context;
use crate::diag;
use crate::errors::{self, CuError, CuResult};
use crate::transfer::{self, Endpoint};
use crate::{event, graph, memory, stream};
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void};

type CudaError = c_int;

thread_local! {
    static LAST: Cell<CudaError> = const { Cell::new(0) };
}

const INVALID_VALUE: CudaError = 1;
const INVALID_MEMCPY_DIRECTION: CudaError = 21;

/// Runs a runtime export on the runtime's context.
fn rt(name: &str, body: impl FnOnce() -> Result<(), CudaError>) -> CudaError {
    diag::boundary(name, || {
        record(
            context::runtime_context()
                .map_err(|e| errors::runtime_code(e.0) as CudaError)
                .and_then(|_| body()),
        )
    })
}

/// Keeps a failure as the thread's last error.
fn record(r: Result<(), CudaError>) -> CudaError {
    match r {
        Ok(()) => 0,
        Err(code) => {
            LAST.set(code);
            code
        }
    }
}

fn cuda<T>(r: CuResult<T>) -> Result<T, CudaError> {
    r.map_err(|e: CuError| errors::runtime_code(e.0) as CudaError)
}

unsafe fn out<T>(ptr: *mut T, value: T) -> Result<(), CudaError> {
    cuda(put(ptr, value))
}

/// Like cudart, neither call creates a context.
#[no_mangle]
pub unsafe extern "C" fn cudaGetDeviceCount(count: *mut c_int) -> CudaError {
    diag::boundary("cudaGetDeviceCount", || {
        context::init();
        record(out(count, crate::config::config().devices))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaSetDevice(device: c_int) -> CudaError {
    diag::boundary("cudaSetDevice", || {
        context::init();
        record(cuda(context::runtime_set_device(device)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetDevice(device: *mut c_int) -> CudaError {
    diag::boundary("cudaGetDevice", || {
        let d = context::current().map_or_else(|_| context::runtime_device(), |c| c.device);
        record(out(device, d))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, bytes: usize) -> CudaError {
    rt("cudaMalloc", || {
        if ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        if bytes == 0 {
            // cudaMalloc(0) succeeds with a NULL pointer.
            return out(ptr, std::ptr::null_mut());
        }
        let ctx = cuda(context::current())?;
        out(
            ptr,
            cuda(driver::mem_alloc(&ctx, bytes, "cudaMalloc"))? as *mut c_void,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> CudaError {
    rt("cudaFree", || {
        cuda(driver::mem_free(ptr as u64, "cudaFree", false))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMallocHost(ptr: *mut *mut c_void, bytes: usize) -> CudaError {
    rt("cudaMallocHost", || {
        if ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        let ctx = cuda(context::current())?;
        out(
            ptr,
            cuda(driver::host_alloc(&ctx, bytes, "cudaMallocHost"))?,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaFreeHost(ptr: *mut c_void) -> CudaError {
    rt("cudaFreeHost", || {
        cuda(driver::mem_free(ptr as u64, "cudaFreeHost", true))
    })
}

/// Endpoints of a cudaMemcpy of `kind` (cudaMemcpyDefault infers them from the table).
fn endpoints(
    dst: *mut c_void,
    src: *const c_void,
    kind: c_int,
) -> Result<(Endpoint, Endpoint), CudaError> {
    let (d, s) = (
        transfer::classify(dst as u64),
        transfer::classify(src as u64),
    );
    let device = |e: &Endpoint| matches!(e, Endpoint::Device(_));
    let ok = match kind {
        0 => !device(&d) && !device(&s),
        1 => device(&d),
        2 => device(&s),
        3 => device(&d) && device(&s),
        4 => true,
        _ => return Err(INVALID_MEMCPY_DIRECTION),
    };
    if !ok {
        return Err(INVALID_VALUE);
    }
    Ok((d, s))
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: c_int,
) -> CudaError {
    rt("cudaMemcpy", || {
        let (d, s) = endpoints(dst, src, kind)?;
        if let (Endpoint::Host(d), Endpoint::Host(s)) = (&d, &s) {
            // Host to host: a plain copy.
            std::ptr::copy(*s as *const u8, *d as *mut u8, bytes);
            return Ok(());
        }
        cuda(driver::memcpy_sync("cudaMemcpy", d, s, bytes as u64))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: c_int,
    stream: *mut c_void,
) -> CudaError {
    rt("cudaMemcpyAsync", || {
        let (d, s) = endpoints(dst, src, kind)?;
        cuda(driver::memcpy_async(
            "cudaMemcpyAsync",
            d,
            s,
            bytes as u64,
            stream.cast(),
        ))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemset(ptr: *mut c_void, value: c_int, bytes: usize) -> CudaError {
    rt("cudaMemset", || {
        cuda(driver::memset(
            "cudaMemset",
            ptr as u64,
            value as u8 as u32,
            1,
            bytes as u64,
            None,
        ))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemsetAsync(
    ptr: *mut c_void,
    value: c_int,
    bytes: usize,
    stream: *mut c_void,
) -> CudaError {
    rt("cudaMemsetAsync", || {
        cuda(driver::memset(
            "cudaMemsetAsync",
            ptr as u64,
            value as u8 as u32,
            1,
            bytes as u64,
            Some(stream.cast()),
        ))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreate(ps: *mut *mut c_void) -> CudaError {
    cudaStreamCreateWithFlags(ps, 0)
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreateWithFlags(
    ps: *mut *mut c_void,
    flags: c_uint,
) -> CudaError {
    rt("cudaStreamCreateWithFlags", || {
        if ps.is_null() {
            return Err(INVALID_VALUE);
        }
        out(ps, cuda(stream::create(flags, 0))?.handle as *mut c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamDestroy(s: *mut c_void) -> CudaError {
    rt("cudaStreamDestroy", || cuda(stream::destroy(s as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamSynchronize(s: *mut c_void) -> CudaError {
    rt("cudaStreamSynchronize", || {
        cuda(driver::stream_synchronize(s.cast()))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamQuery(s: *mut c_void) -> CudaError {
    rt("cudaStreamQuery", || cuda(driver::stream_query(s.cast())))
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamWaitEvent(
    s: *mut c_void,
    e: *mut c_void,
    flags: c_uint,
) -> CudaError {
    rt("cudaStreamWaitEvent", || {
        if flags != 0 {
            return Err(errors::runtime_code(
                errors::not_supported(format_args!("cudaStreamWaitEvent flags {flags:#x}")).0,
            ) as CudaError);
        }
        cuda(event::get(e as usize).and_then(|e| event::wait(s as usize, &e)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceSynchronize() -> CudaError {
    rt("cudaDeviceSynchronize", || {
        let ctx = cuda(context::current())?;
        cuda(driver::synchronize_context(&ctx))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventCreate(pe: *mut *mut c_void) -> CudaError {
    cudaEventCreateWithFlags(pe, 0)
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventCreateWithFlags(
    pe: *mut *mut c_void,
    flags: c_uint,
) -> CudaError {
    rt("cudaEventCreateWithFlags", || {
        if pe.is_null() {
            return Err(INVALID_VALUE);
        }
        out(pe, cuda(event::create(flags))?.handle as *mut c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventRecord(e: *mut c_void, s: *mut c_void) -> CudaError {
    rt("cudaEventRecord", || {
        cuda(event::get(e as usize).and_then(|e| event::record(&e, s as usize)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventQuery(e: *mut c_void) -> CudaError {
    rt("cudaEventQuery", || {
        cuda(event::get(e as usize).and_then(|e| event::query(&e)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventSynchronize(e: *mut c_void) -> CudaError {
    rt("cudaEventSynchronize", || {
        cuda(event::get(e as usize).and_then(|e| event::synchronize(&e)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventElapsedTime(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CudaError {
    rt("cudaEventElapsedTime", || {
        let t = cuda(
            event::get(start as usize)
                .and_then(|a| event::get(end as usize).and_then(|b| event::elapsed(&a, &b))),
        )?;
        out(ms, t)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventDestroy(e: *mut c_void) -> CudaError {
    rt("cudaEventDestroy", || cuda(event::destroy(e as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamBeginCapture(s: *mut c_void, mode: c_uint) -> CudaError {
    rt("cudaStreamBeginCapture", || {
        cuda(stream::resolve(s as usize).and_then(|s| crate::capture::begin(&s, mode)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamEndCapture(
    s: *mut c_void,
    graph: *mut *mut c_void,
) -> CudaError {
    rt("cudaStreamEndCapture", || {
        if graph.is_null() {
            return Err(INVALID_VALUE);
        }
        let (result, g) = driver::end_capture(s.cast());
        *graph = g.cast();
        cuda(result)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphInstantiate(
    exec: *mut *mut c_void,
    g: *mut c_void,
    flags: u64,
) -> CudaError {
    rt("cudaGraphInstantiate", || {
        if flags != 0 {
            return Err(errors::runtime_code(
                errors::not_supported(format_args!("cudaGraphInstantiate flags {flags:#x}")).0,
            ) as CudaError);
        }
        let g = cuda(graph::get(g as usize))?;
        out(exec, graph::instantiate(&g).handle as *mut c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphLaunch(exec: *mut c_void, s: *mut c_void) -> CudaError {
    rt("cudaGraphLaunch", || {
        cuda(
            graph::get_exec(exec as usize)
                .and_then(|e| stream::resolve(s as usize).and_then(|s| graph::launch(&e, &s))),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphDestroy(g: *mut c_void) -> CudaError {
    rt("cudaGraphDestroy", || cuda(graph::destroy(g as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphExecDestroy(exec: *mut c_void) -> CudaError {
    rt("cudaGraphExecDestroy", || {
        cuda(graph::destroy_exec(exec as usize))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetErrorString(error: c_int) -> *const c_char {
    diag::boundary("cudaGetErrorString", || errors::runtime_text(error as u32))
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetErrorName(error: c_int) -> *const c_char {
    diag::boundary("cudaGetErrorName", || errors::runtime_name(error as u32))
}

/// A sticky error of the current context outlives cudaGetLastError, as on a GPU.
fn sticky() -> CudaError {
    driver::current_sticky().map_or(0, |c| errors::runtime_code(c) as CudaError)
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetLastError() -> CudaError {
    diag::boundary("cudaGetLastError", || {
        let last = LAST.replace(0);
        if last != 0 {
            last
        } else {
            sticky()
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaPeekAtLastError() -> CudaError {
    diag::boundary("cudaPeekAtLastError", || match LAST.get() {
        0 => sticky(),
        e => e,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaDriverGetVersion(version: *mut c_int) -> CudaError {
    diag::boundary("cudaDriverGetVersion", || {
        if version.is_null() {
            return INVALID_VALUE;
        }
        *version = crate::config::config().driver_version;
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaRuntimeGetVersion(version: *mut c_int) -> CudaError {
    diag::boundary("cudaRuntimeGetVersion", || {
        if version.is_null() {
            return INVALID_VALUE;
        }
        *version = 12090;
        0
    })
}

/// `struct cudaPointerAttributes` (driver_types.h).
#[repr(C)]
pub struct CudaPointerAttributes {
    pub memory_type: c_int,
    pub device: c_int,
    pub device_pointer: *mut c_void,
    pub host_pointer: *mut c_void,
}

#[no_mangle]
pub unsafe extern "C" fn cudaPointerGetAttributes(
    attrs: *mut CudaPointerAttributes,
    ptr: *const c_void,
) -> CudaError {
    rt("cudaPointerGetAttributes", || {
        if attrs.is_null() {
            return Err(INVALID_VALUE);
        }
        let value = match memory::find(ptr as u64) {
            Some(a) if a.state() == memory::FREED => return Err(INVALID_VALUE),
            Some(a) => {
                let device = cuda(context::get(a.context))?.device;
                let host = a.place == memory::Place::Host;
                CudaPointerAttributes {
                    memory_type: if host { 1 } else { 2 },
                    device,
                    device_pointer: ptr as *mut c_void,
                    host_pointer: if host {
                        ptr as *mut c_void
                    } else {
                        std::ptr::null_mut()
                    },
                }
            }
            None if memory::is_device_range(ptr as u64) => return Err(INVALID_VALUE),
            // Unregistered host memory (CUDA 11+): success, type cudaMemoryTypeUnregistered.
            None => CudaPointerAttributes {
                memory_type: 0,
                device: -2,
                device_pointer: std::ptr::null_mut(),
                host_pointer: ptr as *mut c_void,
            },
        };
        *attrs = value;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceGetAttribute(
    value: *mut c_int,
    attr: c_uint,
    device: c_int,
) -> CudaError {
    rt("cudaDeviceGetAttribute", || {
        // cudaDeviceAttr values are CUdevice_attribute's.
        out(value, cuda(crate::device::attribute(attr, device))?)
    })
}
