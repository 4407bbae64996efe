//! Modules: what `cuModuleLoadData` accepts and what it finds in an image.
//!
//! An image is accepted when it is what NVRTC produces for a runnable architecture:
//! - an ELF cubin (`EM_CUDA` = 190). Its SASS architecture is in `e_flags`: the low byte for
//!   ELF ABI version 7 (NVRTC 12 for sm_5x–sm_9x: sm_90 = 0x5a, sm_90a adds 0x800), bits 8–15
//!   for ABI version 8 (NVRTC 12.8+ for sm_100+, NVRTC 13 for every target; bit 3 of the low
//!   byte marks an `a` target). The CUDA toolkit that built it is in each function's `.nv.info`
//!   attribute `EIATTR_CUDA_API_VERSION` (0x37: 129 for 12.9, 135 for 13.5), with the ABI-7
//!   `e_version` (129) as a fallback. A cubin runs when its major architecture equals the
//!   device's and its minor is not above the device's (`a` targets: exactly the device's), and
//!   its toolkit's major version is not above the driver's.
//! - PTX text: `.version X.Y` no newer than the driver's PTX ISA and `.target sm_XY` no newer
//!   than the device.
//!
//! Function names come from the ELF symbol table (`STT_FUNC` symbols) or the PTX `.entry`
//! directives; a function's launch bound from `EIATTR_MAX_THREADS` (0x05) or `.maxntid`.

use crate::config::config;
use crate::diag;
use crate::errors::{err, CuError, CuResult};
use crate::handles::{self, lock, Registry};
use cudarc::driver::sys::CUresult;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The kernels the emulator can run (kernels/copy.cu, compiled for the host), in the order
/// shim/copy_kernel.cpp numbers them.
pub const RUNNABLE: [&str; 2] = ["ncclReshardCopyKernel", "ncclReshardConvertKernel"];

/// The emulator's number for kernel `name`, if it can run it.
pub fn runnable(name: &str) -> Option<usize> {
    RUNNABLE.iter().position(|&r| r == name)
}

/// The loopback NCCL stand-in's copy kernel (loopback/src/copy.rs): `(u64 dst, u64 src, u64
/// bytes)`, which the emulator runs as a byte copy (`kernel::run_loopback_copy`).
pub const LOOPBACK_COPY: &str = "ncclreshardLoopbackCopy";

/// Whether the emulator can run kernel `name`.
pub fn launchable(name: &str) -> bool {
    runnable(name).is_some() || name == LOOPBACK_COPY
}

/// What kind of image a module came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageKind {
    Cubin {
        sm: u32,
        arch_specific: bool,
        toolkit: Option<u32>,
    },
    Ptx {
        version: (u32, u32),
        sm: u32,
    },
}

/// One function found in an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionInfo {
    pub name: String,
    /// The launch bound (threads per block), when the image states one.
    pub max_threads: Option<u32>,
    /// Bytes of parameters, when the image states it (cubin `EIATTR_CBANK_PARAM_SIZE`).
    pub param_bytes: Option<u32>,
}

/// A parsed image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub kind: ImageKind,
    pub functions: Vec<FunctionInfo>,
}

/// Why an image is refused: the code and the reason (printed).
pub type Refusal = (CUresult, String);

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    b.get(o..o + 2).map(|s| u16::from_le_bytes([s[0], s[1]]))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    b.get(o..o + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    b.get(o..o + 8).map(|s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    })
}

/// The length of an ELF image from its header (section headers usually come last; the largest
/// section end counts too).
///
/// # Safety
/// `image` must point at a readable ELF header; the whole image must be readable up to the
/// returned length (cuModuleLoadData's contract: a complete image).
pub unsafe fn elf_length(image: *const u8) -> Option<usize> {
    // SAFETY: the caller guarantees the 64-byte header is readable.
    let header = std::slice::from_raw_parts(image, 64);
    let shoff = u64_at(header, 0x28)? as usize;
    let shentsize = u16_at(header, 0x3a)? as usize;
    let shnum = u16_at(header, 0x3c)? as usize;
    let mut end = shoff.checked_add(shentsize.checked_mul(shnum)?)?;
    if shentsize < 64 || shnum == 0 {
        return Some(end.max(64));
    }
    // SAFETY: the section header table is inside the image (the caller's contract).
    let table = std::slice::from_raw_parts(image.add(shoff), shentsize * shnum);
    for i in 0..shnum {
        let s = &table[i * shentsize..];
        let kind = u32_at(s, 4)?;
        if kind != 8 {
            // Not SHT_NOBITS.
            end = end.max((u64_at(s, 0x18)? + u64_at(s, 0x20)?) as usize);
        }
    }
    Some(end)
}

struct Section<'a> {
    name: String,
    kind: u32,
    data: &'a [u8],
    link: u32,
}

fn sections(elf: &[u8]) -> Option<Vec<Section<'_>>> {
    let shoff = u64_at(elf, 0x28)? as usize;
    let shentsize = u16_at(elf, 0x3a)? as usize;
    let shnum = u16_at(elf, 0x3c)? as usize;
    let shstrndx = u16_at(elf, 0x3e)? as usize;
    let header = |i: usize| elf.get(shoff + i * shentsize..shoff + (i + 1) * shentsize);
    let data = |h: &[u8]| -> Option<&[u8]> {
        let off = u64_at(h, 0x18)? as usize;
        let size = u64_at(h, 0x20)? as usize;
        if u32_at(h, 4)? == 8 {
            return Some(&[]);
        }
        elf.get(off..off.checked_add(size)?)
    };
    let names = data(header(shstrndx)?)?;
    let mut out = Vec::new();
    for i in 0..shnum {
        let h = header(i)?;
        let name_off = u32_at(h, 0)? as usize;
        let name = names.get(name_off..)?;
        let name = String::from_utf8_lossy(&name[..name.iter().position(|&c| c == 0)?]).into();
        out.push(Section {
            name,
            kind: u32_at(h, 4)?,
            data: data(h)?,
            link: u32_at(h, 0x28)?,
        });
    }
    Some(out)
}

/// (attribute, value bytes) of a `.nv.info*` section.
fn nv_info(data: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    let mut o = 0;
    while o + 2 <= data.len() {
        let (format, attr) = (data[o], data[o + 1]);
        match format {
            // EIFMT_NVAL: no value.
            1 => {
                out.push((attr, &data[o + 2..o + 2]));
                o += 2;
            }
            // EIFMT_BVAL / EIFMT_HVAL: a 2-byte value.
            2 | 3 => {
                if let Some(v) = data.get(o + 2..o + 4) {
                    out.push((attr, v));
                }
                o += 4;
            }
            // EIFMT_SVAL: a 2-byte size, then the value.
            4 => {
                let Some(size) = u16_at(data, o + 2) else {
                    break;
                };
                if let Some(v) = data.get(o + 4..o + 4 + size as usize) {
                    out.push((attr, v));
                }
                o += 4 + size as usize;
            }
            _ => break,
        }
    }
    out
}

const EIATTR_MAX_THREADS: u8 = 0x05;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;
const EIATTR_CUDA_API_VERSION: u8 = 0x37;

fn invalid(why: impl Into<String>) -> Refusal {
    (CUresult::CUDA_ERROR_INVALID_IMAGE, why.into())
}

/// Parses a cubin.
pub fn parse_cubin(elf: &[u8]) -> Result<Image, Refusal> {
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" {
        return Err(invalid("not an ELF image"));
    }
    if elf[4] != 2 || elf[5] != 1 {
        return Err(invalid("not a 64-bit little-endian ELF image"));
    }
    let machine = u16_at(elf, 18).unwrap_or(0);
    if machine != 190 {
        return Err(invalid(format!(
            "ELF machine {machine} is not EM_CUDA (190): not a cubin"
        )));
    }
    let abi = elf[8];
    let flags = u32_at(elf, 48).unwrap_or(0);
    let (sm, arch_specific) = match abi {
        7 => (flags & 0xff, flags & 0x800 != 0),
        8 => ((flags >> 8) & 0xff, flags & 0x8 != 0),
        other => {
            return Err(invalid(format!(
                "unknown CUDA ELF ABI version {other} (known: 7, 8)"
            )))
        }
    };
    let sections = sections(elf).ok_or_else(|| invalid("malformed ELF section headers"))?;
    let mut toolkit = (abi == 7).then(|| u32_at(elf, 20).unwrap_or(0));
    let mut per_function: HashMap<String, (Option<u32>, Option<u32>)> = HashMap::new();
    for s in &sections {
        if s.name.starts_with(".nv.info") {
            let function = s.name.strip_prefix(".nv.info.").map(str::to_string);
            for (attr, value) in nv_info(s.data) {
                match attr {
                    EIATTR_CUDA_API_VERSION => toolkit = u32_at(value, 0).or(toolkit),
                    EIATTR_MAX_THREADS => {
                        if let (Some(f), Some(x), Some(y), Some(z)) = (
                            &function,
                            u32_at(value, 0),
                            u32_at(value, 4),
                            u32_at(value, 8),
                        ) {
                            per_function.entry(f.clone()).or_default().0 = Some(x * y * z);
                        }
                    }
                    EIATTR_CBANK_PARAM_SIZE => {
                        if let (Some(f), Some(v)) = (&function, u16_at(value, 0)) {
                            per_function.entry(f.clone()).or_default().1 = Some(v as u32);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    let mut functions = Vec::new();
    for s in sections.iter().filter(|s| s.kind == 2) {
        let strtab = sections
            .get(s.link as usize)
            .ok_or_else(|| invalid("symbol table without string table"))?;
        for sym in s.data.chunks_exact(24) {
            let (name_off, info) = (u32_at(sym, 0).unwrap_or(0) as usize, sym[4]);
            // STT_FUNC, not local.
            if info & 0xf != 2 || info >> 4 == 0 {
                continue;
            }
            let Some(name) = strtab.data.get(name_off..) else {
                continue;
            };
            let Some(end) = name.iter().position(|&c| c == 0) else {
                continue;
            };
            let name = String::from_utf8_lossy(&name[..end]).into_owned();
            if name.starts_with('$') {
                continue;
            }
            let (max_threads, param_bytes) = per_function.get(&name).copied().unwrap_or_default();
            functions.push(FunctionInfo {
                name,
                max_threads,
                param_bytes,
            });
        }
    }
    Ok(Image {
        kind: ImageKind::Cubin {
            sm,
            arch_specific,
            toolkit,
        },
        functions,
    })
}

/// Parses PTX text.
pub fn parse_ptx(text: &str) -> Result<Image, Refusal> {
    let mut version = None;
    let mut sm = None;
    let mut functions: Vec<FunctionInfo> = Vec::new();
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        match words.next() {
            Some(".version") => {
                let v = words.next().unwrap_or("");
                let (a, b) = v.split_once('.').unwrap_or((v, "0"));
                version = a.parse().ok().zip(b.parse().ok());
            }
            Some(".target") => {
                let t = words.next().unwrap_or("").trim_end_matches(',');
                sm = t
                    .strip_prefix("sm_")
                    .map(|d| d.trim_end_matches(|c: char| c.is_ascii_alphabetic()))
                    .and_then(|d| d.parse().ok());
            }
            Some(".maxntid") => {
                let n: Option<u32> = line
                    .trim_start_matches(".maxntid")
                    .split(',')
                    .map(|x| x.trim().parse::<u32>().ok())
                    .try_fold(1u32, |acc, x| x.map(|x| acc * x));
                if let Some(f) = functions.last_mut() {
                    f.max_threads = n;
                }
            }
            _ => {
                if let Some(pos) = line.find(".entry") {
                    let name: String = line[pos + 6..]
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$')
                        .collect();
                    functions.push(FunctionInfo {
                        name,
                        max_threads: None,
                        param_bytes: None,
                    });
                }
            }
        }
    }
    let (Some(version), Some(sm)) = (version, sm) else {
        return Err(invalid("PTX without .version and .target sm_XY directives"));
    };
    Ok(Image {
        kind: ImageKind::Ptx { version, sm },
        functions,
    })
}

/// The newest PTX ISA a driver version can JIT: 12.0 → 8.0 … 12.4 → 8.4, 12.5/12.6 → 8.5,
/// 12.8 → 8.7, 12.9 → 8.8, 13.x → 9.x, 11.x → 7.x.
pub fn max_ptx_isa(driver_version: i32) -> (u32, u32) {
    let (major, minor) = (
        (driver_version / 1000) as u32,
        ((driver_version % 1000) / 10) as u32,
    );
    match major {
        12 => match minor {
            0..=4 => (8, minor),
            5 | 6 => (8, 5),
            7 => (8, 6),
            8 => (8, 7),
            _ => (8, 8),
        },
        m if m >= 13 => (m - 4, minor),
        m => (m - 4, minor),
    }
}

/// Checks that an image can run on the emulated device with the emulated driver.
pub fn check_runnable(image: &Image) -> Result<(), Refusal> {
    let c = config();
    let (major, minor) = (c.compute_capability.0 as u32, c.compute_capability.1 as u32);
    let device_sm = major * 10 + minor;
    let driver_major = (c.driver_version / 1000) as u32;
    match &image.kind {
        ImageKind::Cubin {
            sm,
            arch_specific,
            toolkit,
        } => {
            let runs = if *arch_specific {
                *sm == device_sm
            } else {
                sm / 10 == major && sm % 10 <= minor
            };
            if !runs {
                return Err((
                    CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU,
                    format!(
                        "the cubin is for sm_{sm}{} but the device is sm_{device_sm}",
                        if *arch_specific { "a" } else { "" }
                    ),
                ));
            }
            if let Some(t) = toolkit {
                if t / 10 > driver_major {
                    return Err(invalid(format!(
                        "the cubin was built by CUDA {}.{} but the driver is CUDA {}.{} (NCCL_RESHARD_EMU_DRIVER_VERSION={})",
                        t / 10,
                        t % 10,
                        driver_major,
                        (c.driver_version % 1000) / 10,
                        c.driver_version
                    )));
                }
            }
        }
        ImageKind::Ptx { version, sm } => {
            let max = max_ptx_isa(c.driver_version);
            if *version > max {
                return Err((
                    CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                    format!(
                        "PTX ISA {}.{} is newer than driver {}'s {}.{}",
                        version.0, version.1, c.driver_version, max.0, max.1
                    ),
                ));
            }
            if *sm > device_sm {
                return Err((
                    CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU,
                    format!("the PTX targets sm_{sm} but the device is sm_{device_sm}"),
                ));
            }
        }
    }
    Ok(())
}

/// Reads and parses an image at `image` (cuModuleLoadData's argument).
///
/// # Safety
/// `image` must point at a complete cubin or NUL-terminated PTX, as cuModuleLoadData requires.
pub unsafe fn parse_at(image: *const u8) -> Result<Image, Refusal> {
    if image.is_null() {
        return Err((CUresult::CUDA_ERROR_INVALID_VALUE, "image is NULL".into()));
    }
    // SAFETY: every image starts with at least 4 readable bytes (ELF magic or PTX text).
    let magic = std::slice::from_raw_parts(image, 4);
    if magic == b"\x7fELF" {
        let len = elf_length(image).ok_or_else(|| invalid("malformed ELF header"))?;
        // SAFETY: a complete image is readable up to its last section (the caller's contract).
        return parse_cubin(std::slice::from_raw_parts(image, len));
    }
    if magic
        .iter()
        .all(|c| c.is_ascii_graphic() || c.is_ascii_whitespace())
    {
        // SAFETY: text images are NUL-terminated (cuModuleLoadData's contract for PTX).
        let text = std::ffi::CStr::from_ptr(image.cast());
        return parse_ptx(&text.to_string_lossy());
    }
    Err(invalid(
        "neither an ELF cubin nor PTX text (fatbins are not supported by the emulator)",
    ))
}

/// A loaded module.
pub struct Module {
    pub handle: usize,
    pub context: usize,
    pub image: Image,
    functions: Mutex<HashMap<String, Arc<Function>>>,
}

/// A function of a loaded module.
pub struct Function {
    pub handle: usize,
    pub module: usize,
    pub context: usize,
    pub info: FunctionInfo,
}

fn modules() -> &'static Registry<Module> {
    static R: OnceLock<Registry<Module>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

fn functions() -> &'static Registry<Function> {
    static R: OnceLock<Registry<Function>> = OnceLock::new();
    R.get_or_init(Registry::default)
}

/// `cuModuleLoadData` in the current context.
pub fn load(context: usize, image: Image, api: &str) -> CuResult<Arc<Module>> {
    if let Err((code, why)) = check_runnable(&image) {
        diag::report(format_args!("{api}: {why}"));
        return err(code);
    }
    let m = Arc::new(Module {
        handle: handles::next(),
        context,
        image,
        functions: Mutex::new(HashMap::new()),
    });
    modules().insert(m.handle, m.clone());
    Ok(m)
}

pub fn get_module(handle: usize) -> CuResult<Arc<Module>> {
    modules()
        .get(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))
}

/// `cuModuleUnload`: its functions become invalid handles.
pub fn unload(handle: usize) -> CuResult<()> {
    let m = modules()
        .remove(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))?;
    for f in lock(&m.functions).values() {
        functions().remove(f.handle);
    }
    Ok(())
}

/// `cuModuleGetFunction`: CUDA_ERROR_NOT_FOUND unless the image has the name.
pub fn get_function(module: usize, name: &str) -> CuResult<Arc<Function>> {
    let m = get_module(module)?;
    let info = m
        .image
        .functions
        .iter()
        .find(|f| f.name == name)
        .cloned()
        .ok_or(CuError(CUresult::CUDA_ERROR_NOT_FOUND))?;
    if runnable(&info.name).is_some() {
        if let Some(bytes) = info.param_bytes {
            let host = crate::kernel::param_layout().total as u32;
            if bytes != host {
                diag::fatal(format_args!(
                    "cuModuleGetFunction: the image's {} takes {bytes} bytes of parameters but the emulator's host build of kernels/copy.cu takes {host}: rebuild the emulator from the same kernels/copy.cu as the library",
                    info.name
                ));
            }
        }
    }
    let mut cache = lock(&m.functions);
    Ok(cache
        .entry(name.to_string())
        .or_insert_with(|| {
            let f = Arc::new(Function {
                handle: handles::next(),
                module: m.handle,
                context: m.context,
                info,
            });
            functions().insert(f.handle, f.clone());
            f
        })
        .clone())
}

pub fn get_function_handle(handle: usize) -> CuResult<Arc<Function>> {
    functions()
        .get(handle)
        .ok_or(CuError(CUresult::CUDA_ERROR_INVALID_HANDLE))
}

/// Drops the modules of a context that ends.
pub fn retire_context(context: usize) {
    for m in modules().all() {
        if m.context == context {
            let _ = unload(m.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_isa_follows_the_driver_table() {
        assert_eq!(max_ptx_isa(12000), (8, 0));
        assert_eq!(max_ptx_isa(12040), (8, 4));
        assert_eq!(max_ptx_isa(12060), (8, 5));
        assert_eq!(max_ptx_isa(12080), (8, 7));
        assert_eq!(max_ptx_isa(12090), (8, 8));
        assert_eq!(max_ptx_isa(13000), (9, 0));
    }

    #[test]
    fn ptx_directives_are_read() {
        let ptx = ".version 8.8\n.target sm_90\n.address_size 64\n.visible .entry ncclReshardCopyKernel(\n.param .u64 a\n)\n.maxntid 256, 1, 1\n{\n}\n";
        let image = parse_ptx(ptx).unwrap();
        assert_eq!(
            image.kind,
            ImageKind::Ptx {
                version: (8, 8),
                sm: 90
            }
        );
        assert_eq!(image.functions[0].name, RUNNABLE[0]);
        assert_eq!(image.functions[0].max_threads, Some(256));
    }
}
