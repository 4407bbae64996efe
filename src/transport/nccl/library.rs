//! NCCL, taken from the process. A communicator is only valid in the libnccl that created it,
//! so the library must use the NCCL the caller's communicators come from, and never map a
//! second copy beside it. The rule ([`choose`]), applied once, at the first use:
//!
//! 1. `NCCL_RESHARD_NCCL_LIBRARY` names a file: it is used if it is not loaded yet and no other
//!    NCCL is mapped, or if it *is* the NCCL already mapped; naming another file while an NCCL
//!    is mapped is refused (loading it would map a second copy).
//! 2. Otherwise the NCCL in the global namespace (`dlsym(RTLD_DEFAULT, …)`: a program linked
//!    against libnccl, or a library loaded `RTLD_GLOBAL`).
//! 3. Otherwise the one NCCL mapped privately (`RTLD_LOCAL`, as Python loads PyTorch's and
//!    vLLM's), whatever its file name; several distinct ones are refused (which one the
//!    caller's communicators belong to cannot be known).
//! 4. Otherwise `dlopen("libnccl.so.2")`.
//!
//! Mapped copies are found with `dl_iterate_phdr`: an object counts as an NCCL when `ncclSend`
//! resolves from it, and two objects are the same NCCL when that symbol resolves to the same
//! definition (a shim whose dependency defines NCCL, or libtorch_cuda's dependency on libnccl,
//! is the NCCL it leads to). Only functions present in NCCL 2.18 are required, so any NCCL
//! from 2.18 on works.

use super::group_depth::GroupDepth;
use crate::debug::{self, Level};
use crate::error::{Error, Result};
use crate::gpu::driver::dlerror;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt::Write as _;
use std::sync::OnceLock;

pub(crate) type NcclResult = c_int;
pub(crate) type NcclComm = *mut c_void;
pub(crate) type CudaStream = *mut c_void;

/// `ncclUint8`: messages are byte counts.
pub(crate) const NCCL_UINT8: c_int = 1;
/// `ncclInvalidUsage`.
const NCCL_INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`: a peer died or the network failed (what a missed deadline reports).
pub(crate) const NCCL_REMOTE_ERROR: NcclResult = 6;
/// `ncclInProgress`: a nonblocking communicator is still issuing the operation.
pub(super) const NCCL_IN_PROGRESS: NcclResult = 7;

// C signatures from nccl.h.
type SendFn =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type CommIntFn = unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult;
type ErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(NcclComm) -> *const c_char;
type VersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type AsyncErrorFn = unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult;
type CommFn = unsafe extern "C" fn(NcclComm) -> NcclResult;
type RevokeFn = unsafe extern "C" fn(NcclComm, c_int) -> NcclResult;
pub(crate) type ShrinkFn = unsafe extern "C" fn(
    NcclComm,
    *mut c_int,
    c_int,
    *mut NcclComm,
    *mut c_void,
    c_int,
) -> NcclResult;
pub(crate) type UniqueIdFn = unsafe extern "C" fn(NcclComm, *mut UniqueId) -> NcclResult;
pub(crate) type GrowFn = unsafe extern "C" fn(
    NcclComm,
    c_int,
    *const UniqueId,
    c_int,
    *mut NcclComm,
    *mut c_void,
) -> NcclResult;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId(pub [u8; 128]);

/// NCCL's fault-tolerance functions and the release that added each (`ncclGetVersion` codes):
/// an NCCL older than that is not asked for them, whatever it exports.
pub(crate) const REVOKE_SINCE: i32 = 22807;
pub(crate) const SHRINK_SINCE: i32 = 22703;
pub(crate) const GROW_SINCE: i32 = 22902;

/// The NCCL functions the executor calls.
pub(crate) struct Nccl {
    pub send: SendFn,
    pub recv: RecvFn,
    pub group_start: GroupFn,
    pub group_end: GroupFn,
    pub comm_count: CommIntFn,
    pub comm_cu_device: CommIntFn,
    pub comm_user_rank: CommIntFn,
    pub get_error_string: ErrorStringFn,
    pub get_last_error: LastErrorFn,
    pub get_version: VersionFn,
    pub comm_get_async_error: AsyncErrorFn,
    pub comm_abort: CommFn,
    /// What this NCCL has of the fault-tolerance API (`None` where it is older).
    pub comm_revoke: Option<RevokeFn>,
    pub comm_shrink: Option<ShrinkFn>,
    pub comm_get_unique_id: Option<UniqueIdFn>,
    pub comm_grow: Option<GrowFn>,
    /// This thread's NCCL group depth, read without NCCL logging anything, where NCCL's
    /// symbol table names it (`group_depth.rs`); else `refuse_open_group` probes.
    group_depth: Option<GroupDepth>,
    /// Where the symbols came from, for messages.
    pub origin: String,
    /// The file that defines them (`ncclReshardGetNcclLibrary`).
    pub path: CString,
}

/// Looks `name` up in `handle` (RTLD_DEFAULT when NULL).
fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: dlsym with a valid handle (or RTLD_DEFAULT) and C string.
    let ptr = unsafe {
        libc::dlsym(
            if handle.is_null() {
                libc::RTLD_DEFAULT
            } else {
                handle
            },
            c.as_ptr(),
        )
    };
    (!ptr.is_null()).then_some(ptr)
}

fn load_from(handle: *mut c_void, origin: String) -> Result<Nccl> {
    macro_rules! resolve {
        ($name:literal, $ty:ty) => {{
            let ptr = symbol(handle, $name).ok_or_else(|| {
                Error::system(format!(
                    "{origin} has no symbol {}; libncclreshard needs NCCL 2.18 or newer",
                    $name
                ))
            })?;
            // SAFETY: the symbol is NCCL's function of that name, whose C signature (nccl.h)
            // is the field's type.
            unsafe { std::mem::transmute::<*mut c_void, $ty>(ptr) }
        }};
    }
    let send = resolve!("ncclSend", SendFn);
    let mapped = defining_object(send as *mut c_void);
    let path = mapped
        .as_ref()
        .map(|m| m.path.clone())
        .unwrap_or_else(|| origin.clone());
    let group_start = resolve!("ncclGroupStart", GroupFn);
    let group_end = resolve!("ncclGroupEnd", GroupFn);
    let group_depth = mapped
        .and_then(|m| GroupDepth::find(&m.path, m.base))
        .and_then(|depth| depth.check(group_start, group_end));
    debug::log(Level::Info, || {
        format!(
            "{path}: {}",
            if group_depth.is_some() {
                "NCCL's group depth found in its symbol table: open groups are detected without ncclGroupEnd"
            } else {
                "NCCL's group depth is not in its symbol table (a stripped NCCL): open groups are detected by ncclGroupEnd, which NCCL logs as a WARN ('not in a group call') with NCCL_DEBUG=WARN for each call of a plan not made in groupable mode"
            }
        )
    });
    let get_version = resolve!("ncclGetVersion", VersionFn);
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { get_version(&mut version) };
    macro_rules! optional {
        ($name:literal, $ty:ty, $since:expr) => {
            symbol(handle, $name)
                .filter(|_| version >= $since)
                .map(|ptr| {
                    // SAFETY: as in `resolve!`.
                    unsafe { std::mem::transmute::<*mut c_void, $ty>(ptr) }
                })
        };
    }
    Ok(Nccl {
        comm_abort: resolve!("ncclCommAbort", CommFn),
        comm_revoke: optional!("ncclCommRevoke", RevokeFn, REVOKE_SINCE),
        comm_shrink: optional!("ncclCommShrink", ShrinkFn, SHRINK_SINCE),
        comm_get_unique_id: optional!("ncclCommGetUniqueId", UniqueIdFn, GROW_SINCE),
        comm_grow: optional!("ncclCommGrow", GrowFn, GROW_SINCE),
        send,
        recv: resolve!("ncclRecv", RecvFn),
        group_start,
        group_end,
        group_depth,
        comm_count: resolve!("ncclCommCount", CommIntFn),
        comm_cu_device: resolve!("ncclCommCuDevice", CommIntFn),
        comm_user_rank: resolve!("ncclCommUserRank", CommIntFn),
        get_error_string: resolve!("ncclGetErrorString", ErrorStringFn),
        get_last_error: resolve!("ncclGetLastError", LastErrorFn),
        get_version,
        comm_get_async_error: resolve!("ncclCommGetAsyncError", AsyncErrorFn),
        origin,
        path: CString::new(path).unwrap_or_default(),
    })
}

fn open(path: &str) -> Result<*mut c_void> {
    let c = CString::new(path)
        .map_err(|_| Error::invalid_argument("NCCL library path has a NUL byte"))?;
    // SAFETY: dlopen with a valid C string; the handle stays open for the process's life.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        Err(Error::system(format!("cannot open {path}: {}", dlerror())))
    } else {
        Ok(handle)
    }
}

/// One NCCL mapped in the process: the object that defines `ncclSend`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mapped {
    /// Its file, as the loader names it.
    pub path: String,
    /// Its load address: equal for two objects iff they are the same NCCL.
    pub base: usize,
}

/// The NCCL that `ncclSend` at `symbol` belongs to.
fn defining_object(symbol: *mut c_void) -> Option<Mapped> {
    // SAFETY: Dl_info is plain data that dladdr fills; all-zero is a valid initial value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and writes `info`.
    if unsafe { libc::dladdr(symbol, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set a NUL-terminated name owned by the loader.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    Some(Mapped {
        path,
        base: info.dli_fbase as usize,
    })
}

/// The NCCL that the already-loaded object `name` leads to (itself or a dependency), if
/// `name` is loaded; never loads anything.
fn mapped_through(name: &CStr) -> Option<Mapped> {
    // SAFETY: RTLD_NOLOAD only returns a handle to an object that is already loaded (matched
    // by name or by file identity), taking a reference that is dropped below.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    let found = symbol(handle, "ncclSend").and_then(defining_object);
    // SAFETY: drops the reference taken above; the object stays loaded (it was before).
    unsafe { libc::dlclose(handle) };
    found
}

/// Every distinct NCCL mapped in the process now, in load order.
pub(crate) fn mapped_copies() -> Vec<Mapped> {
    unsafe extern "C" fn collect(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        names: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader passes a valid info; `names` is the Vec passed below.
        let (info, names) = unsafe { (&*info, &mut *names.cast::<Vec<CString>>()) };
        if !info.dlpi_name.is_null() {
            // SAFETY: a NUL-terminated name owned by the loader for the callback's duration.
            let name = unsafe { CStr::from_ptr(info.dlpi_name) };
            if !name.to_bytes().is_empty() {
                names.push(name.to_owned());
            }
        }
        0
    }
    // Names first, lookups after: dlopen must not run inside dl_iterate_phdr's callback.
    let mut names: Vec<CString> = Vec::new();
    // SAFETY: the callback only copies names into the Vec it is given.
    unsafe { libc::dl_iterate_phdr(Some(collect), (&mut names as *mut Vec<CString>).cast()) };
    let mut copies: Vec<Mapped> = Vec::new();
    for name in names {
        if let Some(found) = mapped_through(&name) {
            if !copies.iter().any(|c| c.base == found.base) {
                copies.push(found);
            }
        }
    }
    copies
}

/// What the rule picked.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Open this file (nothing else is mapped).
    Open(String),
    /// Use this NCCL, already mapped.
    Use(Mapped),
}

/// The discovery rule (module doc), from the facts of the process: `env` is
/// `NCCL_RESHARD_NCCL_LIBRARY` with the mapped NCCL it leads to when it is loaded already,
/// `mapped` every distinct NCCL mapped, `global` the one in the global namespace.
pub(crate) fn choose(
    env: Option<(&str, Option<Mapped>)>,
    mapped: &[Mapped],
    global: Option<Mapped>,
) -> Result<Choice> {
    let listed = || {
        mapped
            .iter()
            .map(|m| m.path.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match env {
        Some((_, Some(same))) => Ok(Choice::Use(same)),
        Some((path, None)) if mapped.is_empty() => Ok(Choice::Open(path.to_string())),
        Some((path, None)) => Err(Error::system(format!(
            "NCCL_RESHARD_NCCL_LIBRARY={path} is not the NCCL already mapped in this process ({}); loading it would map a second NCCL, and a communicator made by one is garbage to the other: unset NCCL_RESHARD_NCCL_LIBRARY, or set it to {}",
            listed(),
            mapped[0].path
        ))),
        None => match (global, mapped.len()) {
            (Some(global), _) => Ok(Choice::Use(global)),
            (None, 0) => Ok(Choice::Open("libnccl.so.2".to_string())),
            (None, 1) => Ok(Choice::Use(mapped[0].clone())),
            (None, _) => Err(Error::system(format!(
                "{} NCCLs are mapped in this process ({}) and none is global; set NCCL_RESHARD_NCCL_LIBRARY to the one whose communicators you pass",
                mapped.len(),
                listed()
            ))),
        },
    }
}

fn load() -> Result<Nccl> {
    let env = std::env::var("NCCL_RESHARD_NCCL_LIBRARY").ok();
    let mapped = mapped_copies();
    let env = match &env {
        Some(path) => {
            let c = CString::new(path.as_str())
                .map_err(|_| Error::invalid_argument("NCCL_RESHARD_NCCL_LIBRARY has a NUL byte"))?;
            Some((path.as_str(), mapped_through(&c)))
        }
        None => None,
    };
    let global = symbol(std::ptr::null_mut(), "ncclSend").and_then(defining_object);
    let from_env = env.is_some();
    let choice = choose(env, &mapped, global.clone())?;
    if mapped.len() > 1 {
        debug::log(Level::Warn, || {
            let mut text = format!("{} NCCLs are mapped in this process:", mapped.len());
            for m in &mapped {
                let _ = write!(text, " {}", m.path);
            }
            text.push_str("; communicators of the others are not valid in the one used");
            text
        });
    }
    let (handle, origin) = match choice {
        Choice::Open(path) => {
            let handle = open(&path).map_err(|e| {
                if from_env {
                    e
                } else {
                    Error::system(format!(
                        "NCCL is not loaded in this process and {}; load PyTorch's or your NCCL first, or set NCCL_RESHARD_NCCL_LIBRARY",
                        e.message
                    ))
                }
            })?;
            let origin = if from_env {
                format!("NCCL_RESHARD_NCCL_LIBRARY={path}")
            } else {
                path
            };
            (handle, origin)
        }
        Choice::Use(m) => {
            let how = if from_env {
                "NCCL_RESHARD_NCCL_LIBRARY, already mapped"
            } else if global.as_ref() == Some(&m) {
                "the process's global NCCL"
            } else {
                "the NCCL mapped in this process"
            };
            let c = CString::new(m.path.as_str())
                .map_err(|_| Error::internal("a loaded library's name has a NUL byte"))?;
            // SAFETY: RTLD_NOLOAD returns the object already mapped (checked above); the
            // reference it takes keeps it loaded for the process's life.
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
            if handle.is_null() {
                return Err(Error::system(format!(
                    "{} was unloaded while libncclreshard looked it up: {}",
                    m.path,
                    dlerror()
                )));
            }
            (handle, format!("{} ({how})", m.path))
        }
    };
    load_from(handle, origin)
}

/// The process's NCCL, loaded once.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<Result<Nccl>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let loaded = load();
        match &loaded {
            Ok(n) => debug::log(Level::Info, || {
                format!("using NCCL {} from {}", n.version(), n.origin)
            }),
            Err(e) => debug::log(Level::Warn, || e.message.clone()),
        }
        loaded
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl Nccl {
    /// An error for a failing NCCL call, with NCCL's own texts.
    pub fn check(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns static strings (or NULL) from these.
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let general = text(unsafe { (self.get_error_string)(result) });
        let last = text(unsafe { (self.get_last_error)(comm) });
        let kind = crate::error::ErrorKind::Nccl(result);
        Err(Error {
            kind,
            message: format!(
                "{what} returned {result} ({general}){}",
                if last.is_empty() {
                    String::new()
                } else {
                    format!(": {last}")
                }
            ),
        })
    }

    /// A fault-tolerance function, or an error naming the NCCL release it needs.
    pub fn require<F: Copy>(&self, f: Option<F>, name: &str, since: i32) -> Result<F> {
        f.ok_or_else(|| {
            Error::invalid_usage(format!(
                "{name} needs NCCL {}.{}.{} or newer, but the process's NCCL is {} ({}); load a newer NCCL (NCCL_RESHARD_NCCL_LIBRARY)",
                since / 10000,
                since / 100 % 100,
                since % 100,
                self.version_text(),
                self.origin
            ))
        })
    }

    /// The version as `2.28.9`.
    pub fn version_text(&self) -> String {
        let v = self.version();
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    }

    /// NCCL's version code (e.g. 22703).
    pub fn version(&self) -> i32 {
        let mut v = 0;
        // SAFETY: writes one int.
        unsafe { (self.get_version)(&mut v) };
        v
    }
}

impl Nccl {
    /// Checks the result of an operation that a nonblocking communicator may still be issuing
    /// (`ncclInProgress`): waits until NCCL has issued it, as NCCL requires before the next
    /// call on that communicator and before anything else is enqueued on its stream (the
    /// operation's kernel is not on the stream until then).
    pub fn check_issued(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        self.check_issued_unless(result, what, comm, &|| false)
    }

    /// [`Nccl::check_issued`] that stops waiting once `stop` says so (a call with a deadline
    /// whose communicator was revoked).
    pub fn check_issued_unless(
        &self,
        result: NcclResult,
        what: &str,
        comm: NcclComm,
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        if result != NCCL_IN_PROGRESS {
            return self.check(result, what, comm);
        }
        loop {
            if stop() {
                return Err(Error::invalid_usage(format!(
                    "{what}: the communicator was revoked while NCCL was issuing the group"
                )));
            }
            let mut state = NCCL_IN_PROGRESS;
            // SAFETY: writes one result for the caller's communicator.
            let queried = unsafe { (self.comm_get_async_error)(comm, &mut state) };
            self.check(queried, "ncclCommGetAsyncError", comm)?;
            if state != NCCL_IN_PROGRESS {
                return self.check(state, what, comm);
            }
            std::thread::yield_now();
        }
    }

    /// Checks the result of `ncclSend`/`ncclRecv` posted inside a group: a nonblocking
    /// communicator may answer `ncclInProgress` there, which the group's end settles.
    pub fn check_posted(&self, result: NcclResult, what: &str, comm: NcclComm) -> Result<()> {
        if result == NCCL_IN_PROGRESS {
            return Ok(());
        }
        self.check(result, what, comm)
    }

    /// Whether open groups are found from NCCL's group depth (no NCCL log line), not by the
    /// `ncclGroupEnd` probe.
    pub fn reads_group_depth(&self) -> bool {
        self.group_depth.is_some()
    }

    /// `Ok` when this thread has no NCCL group open; otherwise `why` as `ncclInvalidUsage`.
    ///
    /// Read from NCCL's group depth where its symbol table names it (`group_depth.rs`).
    /// Elsewhere: NCCL has no query for an open group, but `ncclGroupEnd` with none open returns
    /// `ncclInvalidUsage` and changes nothing (NCCL logs "ncclGroupEnd: not in a group call."
    /// when `NCCL_DEBUG` is WARN or more). With a group open it closes one level (if that was
    /// the outermost, NCCL issues what the caller posted in the group so far); the level is
    /// reopened at once and the message says so.
    pub fn refuse_open_group(&self, why: impl FnOnce() -> String) -> Result<()> {
        if let Some(depth) = &self.group_depth {
            return match depth.read() {
                0 => Ok(()),
                open => Err(Error::invalid_usage(format!(
                    "{} (this thread has {open} NCCL group level(s) open)",
                    why()
                ))),
            };
        }
        // SAFETY: group calls have no preconditions; a closed level is reopened below.
        let ended = unsafe { (self.group_end)() };
        if ended == NCCL_INVALID_USAGE {
            return Ok(());
        }
        // SAFETY: reopens the level closed above.
        let reopened = unsafe { (self.group_start)() };
        let mut message = format!(
            "{} (libncclreshard found the group open by ending it, as NCCL has no query for it: the operations posted in the group before this call were issued; the group was reopened",
            why()
        );
        if ended != 0 && ended != NCCL_IN_PROGRESS {
            message.push_str(&format!("; ncclGroupEnd returned {ended}"));
        }
        if reopened != 0 {
            message.push_str(&format!("; reopening it returned {reopened}"));
        }
        message.push(')');
        Err(Error::invalid_usage(message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn copy(path: &str, base: usize) -> Mapped {
        Mapped {
            path: path.to_string(),
            base,
        }
    }

    #[test]
    fn the_rule_uses_the_nccl_already_in_the_process() {
        let torch = copy("/site-packages/nvidia/nccl/lib/libnccl.so.2", 0x1000);
        let other = copy("/opt/nccl/lib/libnccl.so.2", 0x2000);
        // Nothing mapped: the soname, or the file the variable names.
        assert_eq!(
            choose(None, &[], None).unwrap(),
            Choice::Open("libnccl.so.2".into())
        );
        assert_eq!(
            choose(Some(("/x/libnccl.so", None)), &[], None).unwrap(),
            Choice::Open("/x/libnccl.so".into())
        );
        // One mapped privately (Python's RTLD_LOCAL): that one, whatever its name.
        assert_eq!(
            choose(None, std::slice::from_ref(&torch), None).unwrap(),
            Choice::Use(torch.clone())
        );
        // The variable naming the mapped one (same object, maybe through a symlink or shim).
        assert_eq!(
            choose(
                Some(("/link/libnccl.so.2", Some(torch.clone()))),
                std::slice::from_ref(&torch),
                None
            )
            .unwrap(),
            Choice::Use(torch.clone())
        );
        // The variable naming another file while one is mapped: refused, both named.
        let e = choose(
            Some(("/opt/nccl/lib/libnccl.so.2", None)),
            std::slice::from_ref(&torch),
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::System);
        assert!(
            e.message
                .contains("NCCL_RESHARD_NCCL_LIBRARY=/opt/nccl/lib/libnccl.so.2")
                && e.message.contains("would map a second NCCL")
                && e.message.contains(&torch.path),
            "{}",
            e.message
        );
        // Two private copies: which one the communicators belong to is unknown.
        let both = [torch.clone(), other.clone()];
        let e = choose(None, &both, None).unwrap_err();
        assert!(
            e.message.contains("2 NCCLs are mapped") && e.message.contains(&other.path),
            "{}",
            e.message
        );
        // A global one wins (a program linked against libnccl).
        assert_eq!(
            choose(None, &both, Some(other.clone())).unwrap(),
            Choice::Use(other)
        );
    }

    /// Builds `lib` exporting `ncclSend` (or, with `needs`, an empty shim whose dependency
    /// defines it) with the C compiler; None when there is none.
    fn build(dir: &Path, lib: &str, needs: Option<&Path>) -> Option<PathBuf> {
        let source = dir.join(format!("{lib}.c"));
        let body = if needs.is_some() {
            ""
        } else {
            "int ncclSend(void) { return 0; }\n"
        };
        std::fs::write(&source, body).ok()?;
        let out = dir.join(lib);
        let mut cc = Command::new("cc");
        cc.args(["-shared", "-fPIC", "-o"]).arg(&out).arg(&source);
        if let Some(dep) = needs {
            cc.arg("-Wl,--no-as-needed").arg(dep);
        }
        cc.status().ok()?.success().then_some(out)
    }

    fn dlopen_local(path: &Path) -> *mut c_void {
        let c = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: loads a test library that defines one trivial function.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "{}", dlerror());
        handle
    }

    #[test]
    fn mapped_copies_are_found_by_definition_not_by_name() {
        let dir = std::env::temp_dir().join(format!("ncclreshard-mapped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let Some(real) = build(&dir, "libfakenccl.so.2", None) else {
            eprintln!("skipped: no C compiler");
            return;
        };
        let shim = build(&dir, "libshim.so", Some(&real)).unwrap();
        let twin = dir.join("libtwin.so.2");
        std::fs::copy(&real, &twin).unwrap();
        let before = mapped_copies().len();

        dlopen_local(&real);
        let copies = mapped_copies();
        assert_eq!(copies.len(), before + 1, "{copies:?}");
        let found = copies.last().unwrap().clone();
        assert!(found.path.ends_with("libfakenccl.so.2"), "{found:?}");
        // Private (RTLD_LOCAL): not in the global namespace, yet found.
        assert!(symbol(std::ptr::null_mut(), "ncclSend").is_none());

        // A shim that leads to it is the same NCCL, and so is the file named again.
        dlopen_local(&shim);
        assert_eq!(mapped_copies().len(), before + 1);
        let named = CString::new(real.to_str().unwrap()).unwrap();
        assert_eq!(mapped_through(&named), Some(found.clone()));
        // A copy of the file not loaded yet is not mapped; once loaded it is a second NCCL.
        let twin_name = CString::new(twin.to_str().unwrap()).unwrap();
        assert_eq!(mapped_through(&twin_name), None);
        dlopen_local(&twin);
        let copies = mapped_copies();
        assert_eq!(copies.len(), before + 2, "{copies:?}");
        assert_ne!(copies[before].base, copies[before + 1].base);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
