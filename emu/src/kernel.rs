//! Kernel launches: `kernels/copy.cu` compiled for the host (build.rs, shim/), run block by
//! block and thread by thread on the launching stream's worker, every global access checked by
//! the access hook (`access`) against the allocation table and the stream's device.

use crate::diag;
use crate::handles::lock;
use crate::memory;
use crate::module::Function;
use crate::stream::Exec;
use cudarc::driver::sys::CUresult;
use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

type AccessFn = extern "C" fn(u64, usize, usize, c_int) -> *mut c_void;

extern "C" {
    fn ncclReshardEmuCopyKernelParams(sizes: *mut usize, aligns: *mut usize, max: usize) -> usize;
    fn ncclReshardEmuCopyKernelPosition(out: *mut u32);
    fn ncclReshardEmuCopyKernelRun(
        which: c_int,
        params: *const *const c_void,
        grid: *const u32,
        block: *const u32,
        access: AccessFn,
        block_done: extern "C" fn(),
    ) -> c_int;
}

/// The kernels' parameters (one signature for both), as the C++ compiler lays them out
/// (deduced from the kernels' own signature in shim/copy_kernel.cpp).
pub struct ParamLayout {
    pub sizes: Vec<usize>,
    /// Bytes of the parameter buffer, each parameter at its alignment (the cubin's
    /// EIATTR_CBANK_PARAM_SIZE must equal it).
    pub total: usize,
}

pub fn param_layout() -> &'static ParamLayout {
    static LAYOUT: OnceLock<ParamLayout> = OnceLock::new();
    LAYOUT.get_or_init(|| {
        let mut sizes = [0usize; 32];
        let mut aligns = [0usize; 32];
        // SAFETY: the arrays hold 32 entries; the function fills at most `max` of them.
        let n =
            unsafe { ncclReshardEmuCopyKernelParams(sizes.as_mut_ptr(), aligns.as_mut_ptr(), 32) };
        let mut total = 0usize;
        for i in 0..n {
            total = total.next_multiple_of(aligns[i]) + sizes[i];
        }
        ParamLayout {
            sizes: sizes[..n].to_vec(),
            total,
        }
    })
}

/// One launch, with its parameter values copied at enqueue time.
pub struct Launch {
    pub id: u64,
    pub function: Arc<Function>,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// One buffer per parameter (16-byte aligned storage).
    pub params: Vec<Vec<u128>>,
}

static NEXT_LAUNCH: AtomicU64 = AtomicU64::new(1);

impl Launch {
    /// Copies the parameter values `params[i]` points at.
    ///
    /// # Safety
    /// `params` must hold one readable pointer per kernel parameter, each to a value of that
    /// parameter's type (cuLaunchKernel's contract).
    pub unsafe fn new(
        function: Arc<Function>,
        grid: [u32; 3],
        block: [u32; 3],
        params: *const *const c_void,
    ) -> Launch {
        let sizes: &[usize] = if function.info.name == crate::module::LOOPBACK_COPY {
            &[8, 8, 8]
        } else {
            &param_layout().sizes
        };
        let values = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let mut buffer = vec![0u128; size.div_ceil(16)];
                // SAFETY: the caller's contract: params[i] points at `size` readable bytes.
                std::ptr::copy_nonoverlapping(
                    (*params.add(i)).cast::<u8>(),
                    buffer.as_mut_ptr().cast::<u8>(),
                    size,
                );
                buffer
            })
            .collect();
        Launch {
            id: NEXT_LAUNCH.fetch_add(1, Ordering::Relaxed),
            function,
            grid,
            block,
            params: values,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "kernel {} (launch #{}, grid ({}, {}, {}), block ({}, {}, {}))",
            self.function.info.name,
            self.id,
            self.grid[0],
            self.grid[1],
            self.grid[2],
            self.block[0],
            self.block[1],
            self.block[2]
        )
    }
}

thread_local! {
    static DEVICE: Cell<i32> = const { Cell::new(-1) };
    static WHO: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Which launch, block and thread is running (for fault reports).
fn who() -> String {
    let mut at = [0u32; 6];
    // SAFETY: writes six unsigned ints, read from this thread's kernel state.
    unsafe { ncclReshardEmuCopyKernelPosition(at.as_mut_ptr()) };
    format!(
        "{}, block ({}, {}, {}) thread ({}, {}, {})",
        WHO.with(|w| w.borrow().clone()),
        at[0],
        at[1],
        at[2],
        at[3],
        at[4],
        at[5]
    )
}

/// The kernel's access hook (NCCL_RESHARD_READ/WRITE in shim/cuda_host.h). A GPU faults on an
/// access not aligned to its size ("misaligned address"), so the emulator does too.
extern "C" fn access(addr: u64, bytes: usize, align: usize, write: c_int) -> *mut c_void {
    diag::boundary("kernel access", || {
        if align > 1 && addr % align as u64 != 0 {
            diag::strict(
                format_args!(
                    "{}: {} of {bytes} bytes at {addr:#x}: misaligned address (the access needs {align}-byte alignment; a GPU faults here)",
                    who(),
                    if write != 0 { "write" } else { "read" }
                ),
                (),
            );
            return std::ptr::null_mut();
        }
        match memory::translate(addr, bytes as u64, Some(DEVICE.get())) {
            Ok(p) => p.cast(),
            Err(fault) => {
                diag::strict(fault.describe(&who(), addr, bytes as u64, write != 0), ());
                std::ptr::null_mut()
            }
        }
    })
}

extern "C" fn block_done() {
    crate::completion::progress();
}

/// Runs the loopback stand-in's copy kernel: `bytes` from `src` to `dst`, both checked like
/// any kernel access against the device's allocations (alignment: bytes).
fn run_loopback_copy(launch: &Launch, exec: &Exec<'_>) {
    let word = |i: usize| launch.params[i][0] as u64;
    let (dst, src, bytes) = (word(0), word(1), word(2));
    if bytes == 0 {
        return;
    }
    let device = Some(exec.device());
    let who = || format!("{} on {}", launch.describe(), exec.stream.name());
    let ends = memory::translate(src, bytes, device)
        .map_err(|fault| fault.describe(&who(), src, bytes, false))
        .and_then(|s| {
            memory::translate(dst, bytes, device)
                .map(|d| (s, d))
                .map_err(|fault| fault.describe(&who(), dst, bytes, true))
        });
    match ends {
        // SAFETY: both ranges lie inside live allocations of the stream's device; `copy`
        // allows them to overlap (a message to oneself).
        Ok((s, d)) => unsafe { std::ptr::copy(s, d, bytes as usize) },
        Err(report) => {
            diag::strict(report, ());
            *lock(&exec.stream.context.sticky) = Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        }
    }
}

/// Runs a launch on the stream's worker thread.
pub fn run(launch: &Launch, exec: &Exec<'_>) {
    if launch.function.info.name == crate::module::LOOPBACK_COPY {
        return run_loopback_copy(launch, exec);
    }
    let Some(which) = crate::module::runnable(&launch.function.info.name) else {
        diag::fatal(format_args!(
            "{} on {}: the emulator runs only {}",
            launch.describe(),
            exec.stream.name(),
            crate::module::RUNNABLE.join(" and ")
        ));
    };
    DEVICE.set(exec.device());
    WHO.with(|w| *w.borrow_mut() = format!("{} on {}", launch.describe(), exec.stream.name()));
    let params: Vec<*const c_void> = launch.params.iter().map(|p| p.as_ptr().cast()).collect();
    // SAFETY: `params` holds one value per kernel parameter with the kernel's layout (copied at
    // launch from the caller's values); grid and block hold three entries each; every memory
    // access the kernel makes goes through `access`.
    let faulted = unsafe {
        ncclReshardEmuCopyKernelRun(
            which as c_int,
            params.as_ptr(),
            launch.grid.as_ptr(),
            launch.block.as_ptr(),
            access,
            block_done,
        )
    };
    if faulted != 0 {
        *lock(&exec.stream.context.sticky) = Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
}
