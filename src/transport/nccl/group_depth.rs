//! Whether this thread has an NCCL group open, asked without a word from NCCL.
//!
//! NCCL has no query for it. Ending a group that is not open returns `ncclInvalidUsage` and
//! changes nothing, which `Nccl::refuse_open_group` used on every call of a plan not made in
//! groupable mode; but NCCL logs `ncclGroupEnd: not in a group call.` as a WARN each time,
//! so a job run with `NCCL_DEBUG=WARN` saw one per call. NCCL keeps the depth in a
//! thread-local `int ncclGroupDepth`, not exported but named in the library's symbol table
//! (the NVIDIA wheels keep it). This module finds that variable from the file NCCL was loaded
//! from and reads this thread's copy through the dynamic linker (`__tls_get_addr`), and trusts
//! it only after seeing it follow one `ncclGroupStart`/`ncclGroupEnd` pair exactly; where any
//! step fails (a stripped NCCL, a renamed variable), the library keeps the probe.

use std::ffi::{c_int, c_void, CString};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The variable's name in NCCL's symbol table.
const SYMBOL: &[u8] = b"ncclGroupDepth";

/// `tls_index` of the dynamic linker's `__tls_get_addr`: a module's TLS id and an offset in
/// its TLS block.
#[repr(C)]
struct TlsIndex {
    module: usize,
    offset: usize,
}

type TlsGetAddr = unsafe extern "C" fn(*const TlsIndex) -> *mut c_void;

/// Where this thread's copy of NCCL's group depth is.
pub(crate) struct GroupDepth {
    index: TlsIndex,
    tls_get_addr: TlsGetAddr,
}

// SAFETY: plain numbers and a function pointer of the dynamic linker.
unsafe impl Send for GroupDepth {}
unsafe impl Sync for GroupDepth {}

impl GroupDepth {
    /// The depth variable of the NCCL loaded at `base` from `path`, if its symbol table names
    /// it and the dynamic linker gives its TLS module. Not yet checked: see [`GroupDepth::check`].
    pub fn find(path: &str, base: usize) -> Option<GroupDepth> {
        let offset = tls_symbol(path, SYMBOL)?;
        let module = tls_module(base)?;
        let name = CString::new("__tls_get_addr").ok()?;
        // SAFETY: dlsym with RTLD_DEFAULT and a C string.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        if f.is_null() {
            return None;
        }
        Some(GroupDepth {
            index: TlsIndex {
                module,
                offset: usize::try_from(offset).ok()?,
            },
            // SAFETY: the dynamic linker's `__tls_get_addr`, whose C signature this is.
            tls_get_addr: unsafe { std::mem::transmute::<*mut c_void, TlsGetAddr>(f) },
        })
    }

    /// This thread's group depth.
    pub fn read(&self) -> c_int {
        // SAFETY: the index names a 4-byte TLS variable of a module that stays loaded (NCCL is
        // never unloaded); `__tls_get_addr` allocates this thread's block on first use.
        unsafe {
            (self.tls_get_addr)(&self.index)
                .cast::<c_int>()
                .read_volatile()
        }
    }

    /// Keeps the variable only if it is NCCL's depth: one `group_start` raises it by one and
    /// the matching `group_end` lowers it back (the level opened here is closed here, so an
    /// open group of the caller is untouched and no operation is issued).
    pub fn check(
        self,
        group_start: unsafe extern "C" fn() -> c_int,
        group_end: unsafe extern "C" fn() -> c_int,
    ) -> Option<GroupDepth> {
        let before = self.read();
        // SAFETY: a group level opened and closed at once, with nothing posted in it.
        let (started, inside) = unsafe { (group_start(), self.read()) };
        // SAFETY: closes the level opened above.
        let (ended, after) = unsafe { (group_end(), self.read()) };
        let sound = started == 0
            && (ended == 0 || ended == super::library::NCCL_IN_PROGRESS)
            && (0..1 << 16).contains(&before)
            && inside == before + 1
            && after == before;
        sound.then_some(self)
    }
}

/// The offset in its module's TLS block of the thread-local symbol `name` in the ELF file at
/// `path` (its symbol table, which a stripped file does not have).
fn tls_symbol(path: &str, name: &[u8]) -> Option<u64> {
    const SHT_SYMTAB: u32 = 2;
    const STT_TLS: u8 = 6;
    let file = File::open(path).ok()?;
    let read = |offset: u64, len: usize| -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset).ok()?;
        Some(buf)
    };
    let u16_at = |b: &[u8], i: usize| Some(u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?));
    let u32_at = |b: &[u8], i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
    let u64_at = |b: &[u8], i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
    let header = read(0, 64)?;
    // 64-bit little-endian ELF only (x86-64 and AArch64, where NCCL runs).
    if header.get(..4)? != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
    }
    let section_table = u64_at(&header, 0x28)?;
    let entry = usize::from(u16_at(&header, 0x3a)?);
    let count = usize::from(u16_at(&header, 0x3c)?);
    if entry < 64 || count == 0 {
        return None;
    }
    let sections = read(section_table, entry.checked_mul(count)?)?;
    let section = |i: usize| sections.get(i * entry..i * entry + 64);
    // Symbol and string tables of a large library are a few MB at most; refuse absurd sizes.
    const MOST: u64 = 256 << 20;
    for i in 0..count {
        let s = section(i)?;
        if u32_at(s, 4)? != SHT_SYMTAB {
            continue;
        }
        let (offset, size, link) = (u64_at(s, 24)?, u64_at(s, 32)?, u32_at(s, 40)?);
        let strings = section(usize::try_from(link).ok()?)?;
        let (str_offset, str_size) = (u64_at(strings, 24)?, u64_at(strings, 32)?);
        if size > MOST || str_size > MOST {
            return None;
        }
        let symbols = read(offset, usize::try_from(size).ok()?)?;
        let names = read(str_offset, usize::try_from(str_size).ok()?)?;
        for sym in symbols.chunks_exact(24) {
            if sym[4] & 0xf != STT_TLS || u64_at(sym, 16)? != 4 {
                continue;
            }
            let at = usize::try_from(u32_at(sym, 0)?).ok()?;
            let rest = names.get(at..)?;
            let end = rest.iter().position(|&b| b == 0)?;
            if &rest[..end] == name {
                return u64_at(sym, 8);
            }
        }
    }
    None
}

/// The TLS module id of the loaded object whose load address is `base`.
fn tls_module(base: usize) -> Option<usize> {
    struct Search {
        base: usize,
        module: Option<usize>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader passes a valid info; `data` is the Search below.
        let (info, search) = unsafe { (&*info, &mut *data.cast::<Search>()) };
        if info.dlpi_addr as usize == search.base && info.dlpi_tls_modid != 0 {
            search.module = Some(info.dlpi_tls_modid);
            return 1;
        }
        0
    }
    let mut search = Search { base, module: None };
    // SAFETY: `visit` only reads the infos and writes `search`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&mut search as *mut Search).cast()) };
    search.module
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a real NCCL (`NCCL_RESHARD_TEST_NCCL`: its file; scripts/native-tests.sh sets it
    /// to the NVIDIA wheel's, which needs no GPU for groups): the variable is found, follows
    /// nested groups exactly, and is this thread's alone.
    #[test]
    fn the_depth_of_a_real_nccl_follows_its_groups() {
        let Ok(path) = std::env::var("NCCL_RESHARD_TEST_NCCL") else {
            println!("NCCL_RESHARD_TEST_NCCL unset: no real NCCL to read");
            return;
        };
        let c = CString::new(path.clone()).unwrap();
        // SAFETY: loads NCCL (it stays loaded for the process).
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "cannot load {path}");
        let f = |name: &str| {
            let n = CString::new(name).unwrap();
            // SAFETY: a symbol of the handle above.
            let p = unsafe { libc::dlsym(handle, n.as_ptr()) };
            assert!(!p.is_null(), "{name}");
            // SAFETY: ncclGroupStart/End take nothing and return ncclResult_t.
            unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(p) }
        };
        let (start, end) = (f("ncclGroupStart"), f("ncclGroupEnd"));
        // SAFETY: Dl_info is plain data; dladdr fills it for NCCL's own function.
        let base = unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            assert_ne!(libc::dladdr(start as *const c_void, &mut info), 0);
            info.dli_fbase as usize
        };
        let depth = GroupDepth::find(&path, base)
            .expect("ncclGroupDepth in the symbol table")
            .check(start, end)
            .expect("the variable follows one group");
        assert_eq!(depth.read(), 0);
        // SAFETY: balanced, empty groups.
        unsafe {
            assert_eq!(start(), 0);
            assert_eq!(start(), 0);
            assert_eq!(depth.read(), 2);
            let other = std::thread::scope(|s| s.spawn(|| depth.read()).join().unwrap());
            assert_eq!(other, 0, "another thread's depth");
            assert_eq!(end(), 0);
            assert_eq!(depth.read(), 1);
            assert_eq!(end(), 0);
        }
        assert_eq!(depth.read(), 0);
    }
}
