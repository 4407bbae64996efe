//! The CUDA driver, loaded at run time (`dlopen("libcuda.so.1")`): the real one on a GPU
//! machine, the emulator's (emu/) in CI. Only documented driver calls, each with its C
//! signature from cuda.h; every failure becomes an NCCL error naming the call and CUDA's code.

use crate::report::{fail, NResult, SYSTEM_ERROR, UNHANDLED_CUDA_ERROR};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

pub type CuResult = c_int;
/// A `CUcontext` handle: opaque, never dereferenced here.
pub type Context = usize;
/// A `CUstream` handle as NCCL's callers pass it (NULL and the per-thread handle included).
pub type Stream = usize;
pub type DevicePtr = u64;
/// The C types of the handles.
type RawContext = *mut c_void;
type RawStream = *mut c_void;
type RawModule = *mut c_void;
type RawFunction = *mut c_void;
/// A `CUfunction` handle: opaque, never dereferenced here.
pub type Function = usize;

/// `cuMemHostAlloc` flags: portable (every context may use it) and mapped into the device's
/// address space (with unified addressing its device address is its host address).
pub const HOST_ALLOC_PORTABLE_DEVICEMAP: c_uint = 0x1 | 0x2;
/// `CU_STREAM_WAIT_VALUE_EQ`.
pub const WAIT_EQ: c_uint = 1;
/// `CU_STREAM_WRITE_VALUE_DEFAULT`: the write is ordered after every earlier write of its
/// stream (a fence like `__threadfence_system()` scoped to the stream), so a peer that sees
/// it sees the copy before it.
pub const WRITE_DEFAULT: c_uint = 0;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
pub const CAPTURE_MODE_RELAXED: c_uint = 2;
/// `cudaStreamCaptureStatus` values.
pub const CAPTURE_NONE: c_uint = 0;
pub const CAPTURE_ACTIVE: c_uint = 1;

/// The driver functions the stand-in calls.
pub struct Driver {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut RawContext) -> CuResult,
    ctx_push: unsafe extern "C" fn(RawContext) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut RawContext) -> CuResult,
    ctx_get_device: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut RawContext, c_int) -> CuResult,
    stream_get_ctx: unsafe extern "C" fn(RawStream, *mut RawContext) -> CuResult,
    stream_is_capturing: unsafe extern "C" fn(RawStream, *mut c_uint) -> CuResult,
    exchange_capture_mode: unsafe extern "C" fn(*mut c_uint) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    host_device_pointer: unsafe extern "C" fn(*mut DevicePtr, *mut c_void, c_uint) -> CuResult,
    wait_value: unsafe extern "C" fn(RawStream, DevicePtr, u32, c_uint) -> CuResult,
    write_value: unsafe extern "C" fn(RawStream, DevicePtr, u32, c_uint) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut RawModule, *const c_void) -> CuResult,
    module_get_function:
        unsafe extern "C" fn(*mut RawFunction, RawModule, *const c_char) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        RawFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        RawStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
}

/// The function `name` of the library `handle`, as the function pointer type `F`.
fn symbol<F: Copy>(handle: *mut c_void, name: &str) -> Option<F> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    let c = CString::new(name).expect("no NUL");
    // SAFETY: dlsym with a handle from dlopen and a C string.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    // SAFETY: the symbol is the driver function of that name; the caller's `F` is its C
    // signature (cuda.h), a function pointer of the same size as the address.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

fn load() -> Result<Driver, String> {
    const NAME: &str = "libcuda.so.1";
    let name = CString::new(NAME).expect("no NUL");
    // SAFETY: dlopen with a valid C string; the handle stays open for the process's life.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a C string owned by the loader (or NULL).
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            String::new()
        } else {
            // SAFETY: non-NULL, NUL-terminated.
            unsafe { CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(format!(
            "cannot load the CUDA driver ({NAME}: {why}); the loopback stand-in needs a CUDA driver (or the emulator's, target/emu/lib, on LD_LIBRARY_PATH)"
        ));
    }
    macro_rules! sym {
        ($name:literal) => {
            symbol(handle, $name).ok_or_else(|| {
                format!(
                    "{NAME} has no {}: the loopback stand-in needs a CUDA 12 driver (stream memory operations v2)",
                    $name
                )
            })?
        };
    }
    Ok(Driver {
        init: sym!("cuInit"),
        get_error_name: sym!("cuGetErrorName"),
        ctx_get_current: sym!("cuCtxGetCurrent"),
        ctx_push: sym!("cuCtxPushCurrent_v2"),
        ctx_pop: sym!("cuCtxPopCurrent_v2"),
        ctx_get_device: sym!("cuCtxGetDevice"),
        device_get: sym!("cuDeviceGet"),
        primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
        stream_get_ctx: sym!("cuStreamGetCtx"),
        stream_is_capturing: sym!("cuStreamIsCapturing"),
        exchange_capture_mode: sym!("cuThreadExchangeStreamCaptureMode"),
        mem_host_alloc: sym!("cuMemHostAlloc"),
        host_device_pointer: sym!("cuMemHostGetDevicePointer_v2"),
        wait_value: sym!("cuStreamWaitValue32_v2"),
        write_value: sym!("cuStreamWriteValue32_v2"),
        module_load_data: sym!("cuModuleLoadData"),
        module_get_function: sym!("cuModuleGetFunction"),
        launch_kernel: sym!("cuLaunchKernel"),
    })
}

/// The driver, loaded and initialised once.
pub fn driver() -> NResult<&'static Driver> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    let loaded = DRIVER.get_or_init(|| {
        let d = load()?;
        // SAFETY: cuInit with the only valid flags value.
        let r = unsafe { (d.init)(0) };
        if r != 0 {
            return Err(format!("cuInit returned {}", d.name(r)));
        }
        Ok(d)
    });
    match loaded {
        Ok(d) => Ok(d),
        Err(e) => fail(SYSTEM_ERROR, e.clone()),
    }
}

impl Driver {
    /// `CUDA_ERROR_…` name of a result, with its number.
    pub fn name(&self, r: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: writes one pointer to a static string (or fails).
        if unsafe { (self.get_error_name)(r, &mut p) } == 0 && !p.is_null() {
            // SAFETY: a static NUL-terminated string of the driver.
            let n = unsafe { CStr::from_ptr(p) }.to_string_lossy();
            format!("{n} ({r})")
        } else {
            format!("CUDA error {r}")
        }
    }

    /// An NCCL error for a failed call.
    pub fn check(&self, r: CuResult, what: impl FnOnce() -> String) -> NResult<()> {
        if r == 0 {
            Ok(())
        } else {
            fail(
                UNHANDLED_CUDA_ERROR,
                format!("{} failed: {}", what(), self.name(r)),
            )
        }
    }

    /// The calling thread's current context, or device 0's primary context (what the CUDA
    /// runtime, and so NCCL, would use on a thread that never chose a device).
    pub fn calling_context(&self) -> NResult<Context> {
        let mut ctx: RawContext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        self.check(unsafe { (self.ctx_get_current)(&mut ctx) }, || {
            "cuCtxGetCurrent".into()
        })?;
        if !ctx.is_null() {
            return Ok(ctx as Context);
        }
        let mut dev = 0;
        // SAFETY: writes one device / one handle; the retained context is kept for the
        // process's life, as the runtime keeps it.
        unsafe {
            self.check((self.device_get)(&mut dev, 0), || "cuDeviceGet(0)".into())?;
            self.check((self.primary_ctx_retain)(&mut ctx, dev), || {
                "cuDevicePrimaryCtxRetain(0)".into()
            })?;
        }
        Ok(ctx as Context)
    }

    /// Makes `ctx` current on this thread until the guard is dropped.
    pub fn push(&'static self, ctx: Context) -> NResult<Current> {
        // SAFETY: the driver checks the handle; a context the caller got from the driver.
        self.check(unsafe { (self.ctx_push)(ctx as RawContext) }, || {
            "cuCtxPushCurrent".into()
        })?;
        Ok(Current(self))
    }

    /// The device of the current context.
    pub fn current_device(&self) -> NResult<c_int> {
        let mut dev = -1;
        // SAFETY: writes one int.
        self.check(unsafe { (self.ctx_get_device)(&mut dev) }, || {
            "cuCtxGetDevice".into()
        })?;
        Ok(dev)
    }

    /// The context `stream` belongs to (NULL and the per-thread handle: the current one's).
    pub fn stream_context(&self, stream: Stream) -> NResult<Context> {
        let mut ctx: RawContext = std::ptr::null_mut();
        // SAFETY: writes one handle; the driver checks the stream handle.
        self.check(
            unsafe { (self.stream_get_ctx)(stream as RawStream, &mut ctx) },
            || format!("cuStreamGetCtx(stream {stream:#x})"),
        )?;
        Ok(ctx as Context)
    }

    /// `cudaStreamCaptureStatus` of `stream`.
    pub fn capture_status(&self, stream: Stream) -> NResult<c_uint> {
        let mut status = CAPTURE_NONE;
        // SAFETY: writes one value for a stream handle the caller passed.
        self.check(
            unsafe { (self.stream_is_capturing)(stream as RawStream, &mut status) },
            || format!("cuStreamIsCapturing(stream {stream:#x})"),
        )?;
        Ok(status)
    }

    /// Pinned, portable, device-mapped host memory (current context), with the thread's
    /// capture mode relaxed for the call so that a capture elsewhere is neither broken by it
    /// nor breaks it: (host address, device address). The stream memory operations take device
    /// pointers (cuda.h), which `cuMemHostGetDevicePointer` gives for mapped memory (with
    /// unified addressing, the host address).
    pub fn host_alloc(&self, bytes: usize) -> NResult<(usize, DevicePtr)> {
        let mut mode = CAPTURE_MODE_RELAXED;
        // SAFETY: swaps the thread's mode; restored below.
        let relaxed = unsafe { (self.exchange_capture_mode)(&mut mode) } == 0;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; the memory is kept for the process's life.
        let r = unsafe { (self.mem_host_alloc)(&mut p, bytes, HOST_ALLOC_PORTABLE_DEVICEMAP) };
        if relaxed {
            // SAFETY: restores the mode swapped out above.
            unsafe { (self.exchange_capture_mode)(&mut mode) };
        }
        self.check(r, || format!("cuMemHostAlloc({bytes} bytes)"))?;
        let mut device: DevicePtr = 0;
        // SAFETY: `p` is mapped pinned memory just allocated; writes one pointer.
        self.check(
            unsafe { (self.host_device_pointer)(&mut device, p, 0) },
            || "cuMemHostGetDevicePointer".into(),
        )?;
        Ok((p as usize, device))
    }

    /// Enqueues a wait until `*addr == value` on `stream`.
    pub fn wait_eq(&self, stream: Stream, addr: DevicePtr, value: u32) -> NResult<()> {
        // SAFETY: `addr` is a word of the flag pool (pinned, mapped, never freed).
        self.check(
            unsafe { (self.wait_value)(stream as RawStream, addr, value, WAIT_EQ) },
            || format!("cuStreamWaitValue32_v2(stream {stream:#x}, {addr:#x} == {value})"),
        )
    }

    /// Enqueues `*addr = value` on `stream`, after everything before it.
    pub fn write(&self, stream: Stream, addr: DevicePtr, value: u32) -> NResult<()> {
        // SAFETY: as in `wait_eq`.
        self.check(
            unsafe { (self.write_value)(stream as RawStream, addr, value, WRITE_DEFAULT) },
            || format!("cuStreamWriteValue32_v2(stream {stream:#x}, {addr:#x} = {value})"),
        )
    }

    /// Loads `image` (NUL-terminated PTX) into the current context, kept for the process's
    /// life, and returns its function `name`.
    pub fn load_function(&self, image: &CStr, name: &CStr) -> NResult<Function> {
        let mut module: RawModule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; writes one handle.
        self.check(
            unsafe { (self.module_load_data)(&mut module, image.as_ptr().cast()) },
            || "cuModuleLoadData (the stand-in's copy kernel)".into(),
        )?;
        let mut function: RawFunction = std::ptr::null_mut();
        // SAFETY: a module just loaded; writes one handle.
        self.check(
            unsafe { (self.module_get_function)(&mut function, module, name.as_ptr()) },
            || format!("cuModuleGetFunction({})", name.to_string_lossy()),
        )?;
        Ok(function as Function)
    }

    /// Enqueues `function` on `stream` with `blocks` blocks of `threads` threads and the
    /// parameters `params` points at.
    ///
    /// # Safety
    /// `params` holds one pointer per parameter of `function`, each to a value of its type.
    pub unsafe fn launch(
        &self,
        function: Function,
        blocks: u32,
        threads: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> NResult<()> {
        // SAFETY: per the function's contract; no shared memory, no `extra`.
        self.check(
            unsafe {
                (self.launch_kernel)(
                    function as RawFunction,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream as RawStream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            || format!("cuLaunchKernel ({blocks} x {threads}, stream {stream:#x})"),
        )
    }
}

/// A context made current by [`Driver::push`]; popped when dropped.
pub struct Current(&'static Driver);

impl Drop for Current {
    fn drop(&mut self) {
        let mut ctx: RawContext = std::ptr::null_mut();
        // SAFETY: pops the context pushed by `push`.
        unsafe { (self.0.ctx_pop)(&mut ctx) };
    }
}
