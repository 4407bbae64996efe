//! The CUDA driver, found at run time, and the few calls the library makes to it, through
//! cudarc's `sys` layer (never its safe wrappers: the caller owns the streams, and nothing of
//! theirs may be destroyed by a drop).
//!
//! Nothing CUDA is linked at build time: the driver (libcuda.so.1) is opened by cudarc on first
//! use, which panics when it is missing — so [`init`] checks first and turns absence into an
//! error, and every cudarc call runs inside [`guard`]. Every call goes through [`call`], which
//! also turns a failing `CUresult` into an error carrying the driver's own text.

use crate::error::{panic_message, Error, Result};
use cudarc::driver::sys::{self, CUmemPool_attribute as Attr, CUresult};
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// The text of the last dlopen/dlsym failure.
pub(crate) fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Runs a cudarc call, turning its panics (a missing library or symbol) into errors.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let detail = panic_message(&*panic).unwrap_or_default();
        Error::system(format!("{what}: {detail}"))
    })
}

/// Makes sure the CUDA driver can be loaded and is initialised (once per process).
pub(crate) fn init() -> Result<()> {
    static READY: OnceLock<Result<()>> = OnceLock::new();
    READY
        .get_or_init(|| {
            // SAFETY: only probes whether the library can be opened.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::system(
                    "the CUDA driver (libcuda.so.1) was not found: ncclReshard needs an NVIDIA GPU and driver",
                ));
            }
            // SAFETY: cuInit has no preconditions.
            let status = guard("cuInit", || unsafe { sys::cuInit(0) })?;
            check(status, "cuInit")
        })
        .clone()
}

/// An error for a failing driver call, with the driver's name and text for the code.
pub(crate) fn check(status: CUresult, what: &str) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it NULL.
    let _ = guard("cuGetErrorString", || unsafe {
        sys::cuGetErrorString(status, &mut text)
    });
    let detail = if text.is_null() {
        format!("{status:?}")
    } else {
        // SAFETY: non-NULL pointers from cuGetErrorString are static C strings.
        format!(
            "{status:?}: {}",
            unsafe { CStr::from_ptr(text) }.to_string_lossy()
        )
    };
    Err(Error {
        kind: crate::error::ErrorKind::Cuda,
        message: format!("{what} failed ({detail})"),
    })
}

/// Runs one driver call (`f` returns its `CUresult`).
pub(crate) fn call(what: &str, f: impl FnOnce() -> CUresult) -> Result<()> {
    check(guard(what, f)?, what)
}

/// The device ordinal a device pointer belongs to, or an error when it is not device memory.
pub(crate) fn pointer_device(ptr: usize, name: &str) -> Result<i32> {
    let mut ordinal: i32 = -1;
    // SAFETY: cuPointerGetAttribute writes one int for DEVICE_ORDINAL.
    call("cuPointerGetAttribute", || unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as sys::CUdeviceptr,
        )
    })
    .map_err(|e| {
        Error::invalid_argument(format!(
            "{name} ({ptr:#x}) is not CUDA device memory: {}",
            e.message
        ))
    })?;
    Ok(ordinal)
}

/// The CUDA version the driver supports, as `cuDriverGetVersion` reports it (12080 = 12.8).
pub(crate) fn driver_version() -> Result<i32> {
    let mut version = 0;
    // SAFETY: writes one int.
    call("cuDriverGetVersion", || unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// The context `stream` belongs to (for the legacy and per-thread default streams: the
/// current context).
pub(crate) fn stream_context(stream: sys::CUstream) -> Result<sys::CUcontext> {
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle for a stream handle the caller gave us.
    call("cuStreamGetCtx", || unsafe {
        sys::cuStreamGetCtx(stream, &mut context)
    })
    .map_err(|e| {
        Error::invalid_argument(format!(
            "stream ({stream:p}) is not a valid CUDA stream: {}",
            e.message
        ))
    })?;
    Ok(context)
}

/// True while `stream` is being captured into a CUDA graph. Needs the stream's context current
/// (for the legacy and per-thread default streams it asks about the current context's).
pub(crate) fn is_capturing(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one capture status for a stream the caller owns.
    call("cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(stream, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// A device's primary context, retained for the life of this value.
pub(crate) struct PrimaryContext {
    pub device: sys::CUdevice,
    pub ordinal: i32,
    pub context: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe); the
// value only retains and releases it.
unsafe impl Send for PrimaryContext {}
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(ordinal: i32) -> Result<PrimaryContext> {
        let mut device: sys::CUdevice = 0;
        // SAFETY: writes one device handle.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; released in Drop.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, device)
        })?;
        Ok(PrimaryContext {
            device,
            ordinal,
            context,
        })
    }

    /// Streaming multiprocessors (launches size their grids by it).
    pub fn multiprocessors(&self) -> Result<u32> {
        let mut value = 0i32;
        // SAFETY: writes one int.
        call("cuDeviceGetAttribute (multiprocessors)", || unsafe {
            sys::cuDeviceGetAttribute(
                &mut value,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                self.device,
            )
        })?;
        Ok(value.max(1) as u32)
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        let attr = |a: sys::CUdevice_attribute, what: &str| -> Result<u32> {
            let mut value = 0i32;
            // SAFETY: writes one int.
            call(what, || unsafe {
                sys::cuDeviceGetAttribute(&mut value, a, self.device)
            })?;
            Ok(value as u32)
        };
        Ok((
            attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "compute capability",
            )?,
            attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "compute capability",
            )?,
        ))
    }

    /// Makes the context current on this thread until the guard drops (restoring the caller's).
    pub fn push(&self) -> Result<CurrentContext> {
        // SAFETY: pushes a retained context; popped by the guard.
        call("cuCtxPushCurrent", || unsafe {
            sys::cuCtxPushCurrent_v2(self.context)
        })?;
        Ok(CurrentContext)
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`.
        let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device)
        });
    }
}

/// Pops the context pushed by [`PrimaryContext::push`].
pub(crate) struct CurrentContext;

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed.
        let _ = call("cuCtxPopCurrent", || unsafe {
            sys::cuCtxPopCurrent_v2(&mut previous)
        });
    }
}

/// Device memory owned by the plan (descriptor tables, constants), freed on drop. Must be
/// dropped with its context alive (the owner keeps the PrimaryContext longer).
///
/// It comes from the device's stream-ordered pool and goes back with `cuMemFreeAsync` on the
/// device's release stream: `cuMemFree` would first wait for every stream of the device, so
/// destroying a plan on one thread would wait for other threads' calls, and where ranks of one
/// communicator share a device (the loopback stand-in) for calls that wait for this thread's
/// next operation. A plan is destroyed only once its work has completed (the header's rule),
/// so nothing reads the memory after the free.
pub(crate) struct DeviceBuffer {
    pub ptr: sys::CUdeviceptr,
    /// The stream the memory is freed on.
    release: sys::CUstream,
}

// SAFETY: a device pointer and a stream handle, usable from any thread.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `bytes` from `pool`, usable by any stream once `stream` has been synchronised; freed on
    /// `release`.
    pub fn alloc(
        bytes: usize,
        what: &str,
        pool: &MemoryPool,
        stream: &PrivateStream,
        release: &PrivateStream,
    ) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Ok(DeviceBuffer {
                ptr: 0,
                release: release.0,
            });
        }
        let ptr = pool
            .alloc(bytes, stream.0)
            .map_err(|e| e.context(format!("{bytes} bytes of {what}")))?;
        Ok(DeviceBuffer {
            ptr,
            release: release.0,
        })
    }

    /// Allocates and fills from host memory with a copy ordered on `stream` (our private
    /// warm-up stream): `data` must stay alive, and the buffer unused by others, until that
    /// stream has been synchronised. A synchronous `cuMemcpyHtoD` would not do: from pageable
    /// memory it may return before the data has landed, and the legacy stream it runs on does
    /// not order the caller's non-blocking streams.
    pub fn upload<T: Copy>(
        data: &[T],
        what: &str,
        pool: &MemoryPool,
        stream: &PrivateStream,
        release: &PrivateStream,
    ) -> Result<DeviceBuffer> {
        let bytes = std::mem::size_of_val(data);
        let buffer = DeviceBuffer::alloc(bytes, what, pool, stream, release)?;
        if bytes > 0 {
            // SAFETY: `data` is `bytes` readable bytes and outlives the copy (the caller
            // synchronises `stream` before dropping it); the buffer was just allocated that
            // large.
            call("cuMemcpyHtoDAsync", || unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    buffer.ptr,
                    data.as_ptr().cast::<c_void>(),
                    bytes,
                    stream.0,
                )
            })?;
        }
        Ok(buffer)
    }

    /// Copies the first `out.len()` elements back to the host once `stream` reaches this
    /// point (waits for the stream).
    pub fn download<T: Copy>(&self, out: &mut [T], stream: sys::CUstream) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        if bytes > 0 {
            // SAFETY: the buffer holds at least `bytes` bytes (the caller allocated it so);
            // `out` is `bytes` writable bytes, alive until the synchronisation below.
            call("cuMemcpyDtoHAsync", || unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr().cast::<c_void>(),
                    self.ptr,
                    bytes,
                    stream,
                )
            })?;
        }
        // SAFETY: waits for work enqueued on the caller's stream (not during capture: callers
        // check).
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream)
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: frees memory this value allocated from a pool, once, in the order of the
            // device's release stream (nothing else uses it any more: see the type's doc).
            let _ = call("cuMemFreeAsync", || unsafe {
                sys::cuMemFreeAsync(self.ptr, self.release)
            });
        }
    }
}

/// A loaded module and its two kernels (copies; conversions).
pub(crate) struct Kernel {
    module: sys::CUmodule,
    pub function: sys::CUfunction,
    pub convert: sys::CUfunction,
}

// SAFETY: module and function handles are usable from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Loads `image` (a cubin, or NUL-terminated PTX) into the current context and finds
    /// `name` and `convert` in it.
    pub fn load(image: &[u8], name: &str, convert: &str) -> Result<Kernel> {
        let name =
            std::ffi::CString::new(name).map_err(|_| Error::internal("kernel name has a NUL"))?;
        let convert = std::ffi::CString::new(convert)
            .map_err(|_| Error::internal("kernel name has a NUL"))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a complete image produced by NVRTC (PTX is NUL-terminated).
        call("cuModuleLoadData", || unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        // From here on the module is unloaded on every path (by the value's Drop).
        let mut kernel = Kernel {
            module,
            function: std::ptr::null_mut(),
            convert: std::ptr::null_mut(),
        };
        // SAFETY: looks up functions in the module just loaded.
        call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut kernel.function, kernel.module, name.as_ptr())
        })?;
        // SAFETY: as above.
        call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut kernel.convert, kernel.module, convert.as_ptr())
        })?;
        Ok(kernel)
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: unloads the module this value loaded, once.
        let _ = call("cuModuleUnload", || unsafe {
            sys::cuModuleUnload(self.module)
        });
    }
}

/// Lets this thread make calls that are illegal while a CUDA graph is being captured elsewhere
/// in global mode (allocation, synchronous copies), for as long as it lives, as libraries that
/// allocate on first use must (NCCL does the same): another thread's capture is neither broken
/// nor able to break the warm-up.
pub(crate) struct RelaxedCapture(sys::CUstreamCaptureMode);

impl RelaxedCapture {
    pub fn new() -> Result<RelaxedCapture> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode; the guard swaps it back.
        call("cuThreadExchangeStreamCaptureMode", || unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        Ok(RelaxedCapture(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.0;
        // SAFETY: restores the mode `new` replaced.
        let _ = call("cuThreadExchangeStreamCaptureMode", || unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        });
    }
}

/// A non-blocking stream of our own (in the current context) for warm-up uploads: it orders
/// nothing of the caller's, and synchronising it waits only for our own copies.
pub(crate) struct PrivateStream(pub sys::CUstream);

impl PrivateStream {
    pub fn new() -> Result<PrivateStream> {
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in Drop.
        call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(PrivateStream(stream))
    }

    /// A non-blocking stream at the device's least priority, for side work that must yield
    /// to NCCL's kernels on the caller's stream (whatever that stream's priority).
    pub fn lowest_priority() -> Result<PrivateStream> {
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: writes two ints for the current context.
        call("cuCtxGetStreamPriorityRange", || unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in Drop.
        call("cuStreamCreateWithPriority", || unsafe {
            sys::cuStreamCreateWithPriority(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                least,
            )
        })?;
        Ok(PrivateStream(stream))
    }

    /// True when everything enqueued on the stream has completed (a failed query: false).
    pub fn is_idle(&self) -> bool {
        // SAFETY: a stream this value owns.
        matches!(
            guard("cuStreamQuery", || unsafe { sys::cuStreamQuery(self.0) }),
            Ok(CUresult::CUDA_SUCCESS)
        )
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a stream this value owns.
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(self.0)
        })
    }
}

// SAFETY: stream handles may be used from any thread (the driver API is thread-safe); a
// `SideStream` holding one is used by one call at a time, and the device's release stream only
// takes frees, which the driver orders.
unsafe impl Send for PrivateStream {}
unsafe impl Sync for PrivateStream {}

impl Drop for PrivateStream {
    fn drop(&mut self) {
        // SAFETY: destroys the stream `new` created, once (pending work still completes).
        let _ = call("cuStreamDestroy", || unsafe {
            sys::cuStreamDestroy_v2(self.0)
        });
    }
}

/// An event without timing, for waiting on a point of a stream from the host or from another
/// stream.
pub(crate) struct Event(sys::CUevent);

// SAFETY: event handles may be used from any thread (the driver API is thread-safe); a
// `SideStream` holding them is used by one call at a time.
unsafe impl Send for Event {}

impl Event {
    pub fn new() -> Result<Event> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed in Drop.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        Ok(Event(event))
    }

    pub fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: our event, the caller's stream.
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(self.0, stream)
        })
    }

    /// Makes later work on `stream` wait until the point last recorded has passed.
    pub fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: our event, a stream of the caller's or ours.
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream, self.0, 0)
        })
    }

    /// True once the stream has passed the recorded point.
    pub fn is_done(&self) -> Result<bool> {
        // SAFETY: our event.
        let status = guard("cuEventQuery", || unsafe { sys::cuEventQuery(self.0) })?;
        if status == CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(status, "cuEventQuery").map(|()| true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroys the event `new` created, once.
        let _ = call("cuEventDestroy", || unsafe {
            sys::cuEventDestroy_v2(self.0)
        });
    }
}

/// A stream-ordered memory pool on one device for staging: a call allocates its staging on
/// its stream when it starts and frees it on its stream when its last unpack is enqueued, so
/// concurrent calls on different streams never share memory, a CUDA graph capture records the
/// allocation as a graph memory node, and nothing is tied to a stream handle.
///
/// Every other GPU of the process that can reach this one may access the pool's memory: when
/// NCCL ranks share a process, NCCL's peer-to-peer transport reads and writes buffers directly
/// from the peer GPU, and peer access does not cover pool memory without
/// `cuMemPoolSetAccess`. By default the pool keeps nothing (release threshold 0): freed staging
/// goes back to the driver at the next synchronization of the device, so it is not hidden
/// from other allocators (PyTorch's, vLLM's) between calls; `keep` holds it for reuse until
/// [`MemoryPool::trim`] instead (docs/executor.md, "Staging memory").
pub(crate) struct MemoryPool(sys::CUmemoryPool);

// SAFETY: pool handles may be used from any thread (the driver API is thread-safe).
unsafe impl Send for MemoryPool {}
unsafe impl Sync for MemoryPool {}

impl MemoryPool {
    /// A pool on device `device` (ordinal `ordinal`); needs that device's context current.
    pub fn new(device: sys::CUdevice, ordinal: i32, keep: bool) -> Result<MemoryPool> {
        let mut supported = 0;
        // SAFETY: writes one int.
        call("cuDeviceGetAttribute", || unsafe {
            sys::cuDeviceGetAttribute(
                &mut supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
                device,
            )
        })?;
        if supported == 0 {
            return Err(Error::system(format!(
                "device {ordinal} does not support stream-ordered memory pools (CUDA 11.2 or newer driver and GPU needed); staged plans allocate their staging from one"
            )));
        }
        // SAFETY: all-zero is a valid bit pattern for this plain C struct (its "unset" value).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ordinal;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes one pool handle from valid properties.
        call("cuMemPoolCreate", || unsafe {
            sys::cuMemPoolCreate(&mut pool, &props)
        })?;
        let pool = MemoryPool(pool);
        pool.grant_peers(device)?;
        let mut threshold = if keep { u64::MAX } else { 0 };
        // SAFETY: RELEASE_THRESHOLD takes a u64.
        unsafe { pool.set(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut threshold) }?;
        // No reuse that makes one stream wait for another's free: an allocation on one call's
        // stream would then wait for an unrelated call's NCCL work (another communicator,
        // another thread), which waits for peers, whose own pools may order the two calls the
        // other way round: a wait across ranks that no rank's program holds.
        let mut internal: i32 = 0;
        // SAFETY: REUSE_ALLOW_INTERNAL_DEPENDENCIES takes an int.
        unsafe {
            pool.set(
                Attr::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                &mut internal,
            )
        }?;
        Ok(pool)
    }

    /// Sets attribute `attr` to `value`.
    ///
    /// # Safety
    /// `T` is the type CUDA takes for `attr` (cuda.h).
    unsafe fn set<T>(&self, attr: Attr, value: &mut T) -> Result<()> {
        // SAFETY: our pool; `value` points at the attribute's type (the caller's contract).
        call("cuMemPoolSetAttribute", || unsafe {
            sys::cuMemPoolSetAttribute(self.0, attr, (value as *mut T).cast::<c_void>())
        })
    }

    /// Read and write access for every other device of the process that can access `device`
    /// as a peer.
    fn grant_peers(&self, device: sys::CUdevice) -> Result<()> {
        let mut count = 0;
        // SAFETY: writes one int.
        call("cuDeviceGetCount", || unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        let mut grants = Vec::new();
        for ordinal in 0..count {
            let mut peer: sys::CUdevice = 0;
            // SAFETY: writes one device handle for an ordinal below the count.
            call("cuDeviceGet", || unsafe {
                sys::cuDeviceGet(&mut peer, ordinal)
            })?;
            if peer == device {
                continue;
            }
            let mut can = 0;
            // SAFETY: writes one int for two valid devices.
            call("cuDeviceCanAccessPeer", || unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, peer, device)
            })?;
            if can != 0 {
                // SAFETY: all-zero is a valid bit pattern for this plain C struct.
                let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                desc.location.id = ordinal;
                desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                grants.push(desc);
            }
        }
        if grants.is_empty() {
            return Ok(());
        }
        // SAFETY: `grants` holds `len` initialised descriptors of peer devices.
        call("cuMemPoolSetAccess", || unsafe {
            sys::cuMemPoolSetAccess(self.0, grants.as_ptr(), grants.len())
        })
    }

    /// `bytes` usable by work enqueued on `stream` after this call.
    pub fn alloc(&self, bytes: usize, stream: sys::CUstream) -> Result<sys::CUdeviceptr> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; freed by `free` in stream order.
        call(
            &format!("cuMemAllocFromPoolAsync ({bytes} bytes of staging)"),
            || unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, self.0, stream) },
        )?;
        Ok(ptr)
    }

    /// Returns `ptr` to the pool once `stream` reaches this point.
    pub fn free(&self, ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
        // SAFETY: `ptr` came from `alloc` and is freed once, in stream order.
        call("cuMemFreeAsync", || unsafe {
            sys::cuMemFreeAsync(ptr, stream)
        })
    }

    /// Gives back to the driver the memory no allocation uses.
    pub fn trim(&self) {
        // SAFETY: trims our own pool; memory in use is kept.
        let _ = call("cuMemPoolTrimTo", || unsafe {
            sys::cuMemPoolTrimTo(self.0, 0)
        });
    }
}
