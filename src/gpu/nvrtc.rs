//! Compiling kernels/copy.cu with NVRTC for a device, cached per process.
//!
//! NVRTC is opened directly (not through cudarc, whose lookup knows only the CUDA 12 names).
//! Which one: `NCCL_RESHARD_NVRTC_LIBRARY` when set, else every `libnvrtc.so.13`, `.so.12`,
//! `.so.11.2`, `libnvrtc.so` the loader finds; among them one already loaded in the process
//! (PyTorch's) is preferred, then the newest. An NVRTC newer than the driver is never used for a
//! device: a cubin or PTX of CUDA 13 does not load on a CUDA 12 driver. When the chosen NVRTC
//! does not know the device's architecture (an older toolkit on a newer GPU), the kernel is
//! compiled to PTX for the newest architecture it knows below the device's, and the driver
//! compiles that at load time.

use super::driver::dlerror;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel source, embedded so users need no file and no CUDA toolkit headers.
pub const KERNEL_SOURCE: &str = include_str!("../../kernels/copy.cu");
/// The copy kernel's entry point (packs, unpacks, local copies).
pub const KERNEL_NAME: &str = "ncclReshardCopyKernel";
/// The conversion kernel's entry point (every pass of a conversion; same parameters).
pub const CONVERT_KERNEL_NAME: &str = "ncclReshardConvertKernel";

/// What a compilation produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for `sm_XY`.
    Cubin,
    /// PTX for `compute_XY` (NUL-terminated), compiled by the driver at load time.
    Ptx,
}

/// Compiled code for one architecture and what NVRTC said while compiling it.
#[derive(Debug)]
pub struct Compiled {
    pub image: Vec<u8>,
    pub kind: ImageKind,
    /// The architecture compiled for (`90` for sm_90 or compute_90).
    pub arch: u32,
    /// The NVRTC used (file name and version), for messages.
    pub compiler: String,
    pub log: String,
}

type Program = *mut c_void;
type Status = c_int;

// Signatures from nvrtc.h (stable since CUDA 11.2).
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type FillFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
type CountFn = unsafe extern "C" fn(*mut c_int) -> Status;
type ArchsFn = unsafe extern "C" fn(*mut c_int) -> Status;

/// One NVRTC library and the functions used.
struct Nvrtc {
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: FillFn,
    cubin_size: SizeFn,
    cubin: FillFn,
    ptx_size: SizeFn,
    ptx: FillFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
    candidate: Candidate,
    /// Architectures it compiles for (`nvrtcGetSupportedArchs`), ascending.
    archs: Vec<u32>,
}

/// An NVRTC found on this machine, as [`choose`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    /// (major, minor) from `nvrtcVersion`.
    pub version: (i32, i32),
    /// Already loaded in the process before we looked (PyTorch's, say).
    pub preloaded: bool,
}

/// The NVRTC to compile with for a driver of CUDA version `driver` (as `cuDriverGetVersion`
/// gives it; `None` when no device is involved): not newer than the driver's major version,
/// one already loaded in the process first, then the newest. `Err` says why none fits.
pub fn choose(found: &[Candidate], driver: Option<i32>) -> std::result::Result<usize, String> {
    let fits = |c: &Candidate| driver.map_or(true, |d| c.version.0 <= d / 1000);
    found
        .iter()
        .enumerate()
        .filter(|(_, c)| fits(c))
        .max_by_key(|(_, c)| (c.preloaded, c.version))
        .map(|(i, _)| i)
        .ok_or_else(|| {
            let d = driver.unwrap_or_default();
            let newer: Vec<String> = found
                .iter()
                .map(|c| format!("{} is NVRTC {}.{}", c.name, c.version.0, c.version.1))
                .collect();
            format!(
                "{}, newer than the CUDA driver (it supports CUDA {}.{}): code it compiles does not load on that driver. Install an NVRTC of CUDA {} (e.g. `pip install nvidia-cuda-nvrtc-cu{}`) and set NCCL_RESHARD_NVRTC_LIBRARY to it, or update the driver",
                newer.join(", "),
                d / 1000,
                d % 1000 / 10,
                d / 1000,
                d / 1000
            )
        })
}

/// What to compile for a device of architecture `device` (e.g. 90) with an NVRTC that knows
/// `archs` (ascending): a cubin for the device's own architecture when it is known, else PTX for
/// the newest known architecture below it (the driver finishes it at load time).
pub fn target(archs: &[u32], device: u32) -> Option<(ImageKind, u32)> {
    if archs.contains(&device) {
        return Some((ImageKind::Cubin, device));
    }
    archs
        .iter()
        .copied()
        .filter(|&a| a <= device)
        .max()
        .map(|a| (ImageKind::Ptx, a))
}

fn open_candidate(name: &str) -> std::result::Result<Nvrtc, String> {
    let c = CString::new(name).map_err(|_| format!("{name} (path has a NUL byte)"))?;
    // SAFETY: dlopen with a valid C string; RTLD_NOLOAD only asks whether it is loaded.
    let preloaded =
        !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) }.is_null();
    // SAFETY: as above; the handle stays open for the process's life.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!("{name} ({})", dlerror()));
    }
    let sym = |symbol: &str| -> std::result::Result<*mut c_void, String> {
        let s = CString::new(symbol).expect("symbol names have no NUL");
        // SAFETY: dlsym on the handle just opened.
        let p = unsafe { libc::dlsym(handle, s.as_ptr()) };
        (!p.is_null())
            .then_some(p)
            .ok_or_else(|| format!("{name} (no {symbol}: NVRTC 11.2 or newer needed)"))
    };
    // SAFETY: each symbol is NVRTC's function of that name with the field's C signature.
    unsafe {
        use std::mem::transmute as t;
        let version = t::<*mut c_void, VersionFn>(sym("nvrtcVersion")?);
        let count = t::<*mut c_void, CountFn>(sym("nvrtcGetNumSupportedArchs")?);
        let list = t::<*mut c_void, ArchsFn>(sym("nvrtcGetSupportedArchs")?);
        let (mut major, mut minor) = (0, 0);
        if version(&mut major, &mut minor) != 0 {
            return Err(format!("{name} (nvrtcVersion failed)"));
        }
        let mut n = 0;
        let mut archs = Vec::new();
        if count(&mut n) == 0 && n > 0 {
            let mut raw = vec![0 as c_int; n as usize];
            if list(raw.as_mut_ptr()) == 0 {
                archs = raw
                    .into_iter()
                    .filter(|&a| a > 0)
                    .map(|a| a as u32)
                    .collect();
            }
        }
        archs.sort_unstable();
        Ok(Nvrtc {
            create: t::<*mut c_void, CreateFn>(sym("nvrtcCreateProgram")?),
            compile: t::<*mut c_void, CompileFn>(sym("nvrtcCompileProgram")?),
            log_size: t::<*mut c_void, SizeFn>(sym("nvrtcGetProgramLogSize")?),
            log: t::<*mut c_void, FillFn>(sym("nvrtcGetProgramLog")?),
            cubin_size: t::<*mut c_void, SizeFn>(sym("nvrtcGetCUBINSize")?),
            cubin: t::<*mut c_void, FillFn>(sym("nvrtcGetCUBIN")?),
            ptx_size: t::<*mut c_void, SizeFn>(sym("nvrtcGetPTXSize")?),
            ptx: t::<*mut c_void, FillFn>(sym("nvrtcGetPTX")?),
            destroy: t::<*mut c_void, DestroyFn>(sym("nvrtcDestroyProgram")?),
            error_string: t::<*mut c_void, ErrorStringFn>(sym("nvrtcGetErrorString")?),
            candidate: Candidate {
                name: name.to_string(),
                version: (major, minor),
                preloaded,
            },
            archs,
        })
    }
}

/// Every NVRTC found (opened once per process), and what was tried.
fn found() -> &'static (Vec<Nvrtc>, Vec<String>) {
    static FOUND: OnceLock<(Vec<Nvrtc>, Vec<String>)> = OnceLock::new();
    FOUND.get_or_init(|| {
        let names: Vec<String> = match std::env::var("NCCL_RESHARD_NVRTC_LIBRARY") {
            Ok(path) => vec![path],
            Err(_) => [
                "libnvrtc.so.13",
                "libnvrtc.so.12",
                "libnvrtc.so.11.2",
                "libnvrtc.so",
            ]
            .map(String::from)
            .to_vec(),
        };
        let (mut ok, mut tried) = (Vec::new(), Vec::new());
        for name in &names {
            match open_candidate(name) {
                Ok(n) => ok.push(n),
                Err(why) => tried.push(why),
            }
        }
        (ok, tried)
    })
}

/// The NVRTC to use for a driver of CUDA version `driver` (`None`: no device involved).
fn nvrtc(driver: Option<i32>) -> Result<&'static Nvrtc> {
    let (libs, tried) = found();
    if libs.is_empty() {
        return Err(Error::system(format!(
            "NVRTC was not found (tried {}); it compiles the copy kernels at first use. Install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`, and put its lib directory on LD_LIBRARY_PATH or set NCCL_RESHARD_NVRTC_LIBRARY to the file",
            tried.join(", ")
        )));
    }
    let candidates: Vec<Candidate> = libs.iter().map(|n| n.candidate.clone()).collect();
    choose(&candidates, driver)
        .map(|i| &libs[i])
        .map_err(Error::system)
}

impl Nvrtc {
    fn check(&self, status: Status, what: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for any status.
        let text = unsafe { std::ffi::CStr::from_ptr((self.error_string)(status)) };
        Err(Error::system(format!(
            "{what} ({}): {}",
            self.candidate.name,
            text.to_string_lossy()
        )))
    }

    fn describe(&self) -> String {
        let (major, minor) = self.candidate.version;
        format!("{} (NVRTC {major}.{minor})", self.candidate.name)
    }

    /// Compiles the kernel to `kind` for architecture `arch`.
    fn build(&self, kind: ImageKind, arch: u32) -> Result<Compiled> {
        let source =
            CString::new(KERNEL_SOURCE).map_err(|_| Error::internal("kernel source has a NUL"))?;
        let prefix = match kind {
            ImageKind::Cubin => "sm",
            ImageKind::Ptx => "compute",
        };
        let options: Vec<CString> = [
            format!("--gpu-architecture={prefix}_{arch}"),
            "-std=c++17".into(),
        ]
        .into_iter()
        .map(|o| CString::new(o).expect("options have no NUL"))
        .collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid C strings; `prog` is destroyed below exactly once.
        self.check(
            unsafe {
                (self.create)(
                    &mut prog,
                    source.as_ptr(),
                    c"copy.cu".as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        // SAFETY: `prog` is a live program; buffers are sized from NVRTC's own size queries.
        let outcome = unsafe {
            let compiled = (self.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr());
            let mut size = 0usize;
            let mut log = String::new();
            if (self.log_size)(prog, &mut size) == 0 && size > 1 {
                let mut text = vec![0u8; size];
                if (self.log)(prog, text.as_mut_ptr().cast()) == 0 {
                    log = String::from_utf8_lossy(&text[..size - 1])
                        .trim()
                        .to_string();
                }
            }
            if compiled != 0 {
                let failure = self.check(compiled, "nvrtcCompileProgram").unwrap_err();
                Err(Error::system(format!(
                    "{} for {prefix}_{arch}:\n{log}",
                    failure.message
                )))
            } else {
                let (size_fn, fill_fn, what) = match kind {
                    ImageKind::Cubin => (self.cubin_size, self.cubin, "nvrtcGetCUBIN"),
                    ImageKind::Ptx => (self.ptx_size, self.ptx, "nvrtcGetPTX"),
                };
                let mut size = 0usize;
                self.check(size_fn(prog, &mut size), what).and_then(|()| {
                    // PTX sizes count its terminating NUL, which cuModuleLoadData needs.
                    let mut image = vec![0u8; size];
                    self.check(fill_fn(prog, image.as_mut_ptr().cast()), what)
                        .map(|()| Compiled {
                            image,
                            kind,
                            arch,
                            compiler: self.describe(),
                            log,
                        })
                })
            }
        };
        // SAFETY: destroys the program created above.
        unsafe { (self.destroy)(&mut prog) };
        outcome
    }
}

/// Compiles the copy kernel to a cubin for `sm_{major}{minor}` with the newest NVRTC found
/// (no driver involved: for checking the kernel compiles).
pub fn compile(major: u32, minor: u32) -> Result<Compiled> {
    nvrtc(None)?.build(ImageKind::Cubin, major * 10 + minor)
}

/// Compiles the copy kernel to PTX for `compute_{major}{minor}` with the newest NVRTC found
/// (no driver involved: for checking which instructions the kernel uses).
pub fn compile_ptx(major: u32, minor: u32) -> Result<Compiled> {
    nvrtc(None)?.build(ImageKind::Ptx, major * 10 + minor)
}

/// The kernel image for a device of compute capability `major.minor` under a driver of CUDA
/// version `driver`, compiled once per process and (architecture, driver).
pub fn image(major: u32, minor: u32, driver: i32) -> Result<Arc<Compiled>> {
    type Cache = Mutex<HashMap<(u32, i32), Arc<Compiled>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let arch = major * 10 + minor;
    let cache = CACHE.get_or_init(Default::default);
    let lock = || {
        cache
            .lock()
            .map_err(|_| Error::internal("kernel cache poisoned"))
    };
    if let Some(hit) = lock()?.get(&(arch, driver)) {
        return Ok(hit.clone());
    }
    let n = nvrtc(Some(driver))?;
    let (kind, target_arch) = target(&n.archs, arch).ok_or_else(|| {
        Error::system(format!(
            "{} compiles for architectures {:?} only, none at or below the device's sm_{arch}",
            n.describe(),
            n.archs
        ))
    })?;
    let compiled = Arc::new(n.build(kind, target_arch)?);
    lock()?.insert((arch, driver), compiled.clone());
    Ok(compiled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(name: &str, version: (i32, i32), preloaded: bool) -> Candidate {
        Candidate {
            name: name.into(),
            version,
            preloaded,
        }
    }

    #[test]
    fn never_newer_than_the_driver_preferring_the_process_own_then_the_newest() {
        let found = [
            candidate("libnvrtc.so.13", (13, 0), false),
            candidate("libnvrtc.so.12", (12, 9), false),
            candidate("libnvrtc.so.11.2", (11, 8), false),
        ];
        assert_eq!(choose(&found, Some(13000)), Ok(0));
        assert_eq!(
            choose(&found, Some(12080)),
            Ok(1),
            "CUDA 13 code on a 12.8 driver"
        );
        assert_eq!(choose(&found, Some(11080)), Ok(2));
        assert_eq!(choose(&found, None), Ok(0));
        let mut torch = found.clone();
        torch[2].preloaded = true;
        assert_eq!(
            choose(&torch, Some(13000)),
            Ok(2),
            "the process's own first"
        );
        let err = choose(&found[..1], Some(12080)).unwrap_err();
        assert!(
            err.contains(
                "libnvrtc.so.13 is NVRTC 13.0, newer than the CUDA driver (it supports CUDA 12.8)"
            ) && err.contains("nvidia-cuda-nvrtc-cu12"),
            "{err}"
        );
    }

    #[test]
    fn a_known_architecture_gets_a_cubin_an_unknown_one_ptx_for_the_newest_below() {
        let archs = [75, 80, 86, 89, 90];
        assert_eq!(target(&archs, 90), Some((ImageKind::Cubin, 90)));
        assert_eq!(target(&archs, 100), Some((ImageKind::Ptx, 90)));
        assert_eq!(target(&archs, 87), Some((ImageKind::Ptx, 86)));
        assert_eq!(target(&archs, 70), None);
    }
}
