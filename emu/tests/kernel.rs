//! Modules and the copy kernel: which images load (NVRTC's cubins and PTX, checked against the
//! emulated architecture and driver), which functions exist, launch limits, and
//! kernels/copy.cu run on the host through cuLaunchKernel moving exactly the bytes its
//! descriptors say, with every access bounds-checked.

mod common;

use common::*;
use cudarc::driver::sys::{CUdeviceptr, CUfunction, CUmodule, CUresult, CUstream};
use ncclreshard_emu::*;
use std::ffi::{c_void, CString};

// ---- images ----

fn section_header(out: &mut Vec<u8>, name: u32, kind: u32, offset: u64, size: u64, link: u32) {
    out.extend_from_slice(&name.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&[0u8; 16]); // flags, addr
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(&link.to_le_bytes());
    out.extend_from_slice(&[0u8; 20]); // info, addralign, entsize
}

/// A minimal cubin: the ELF header fields NVRTC sets, one global function symbol per name and
/// an `.nv.info.<name>` section with EIATTR_CUDA_API_VERSION and EIATTR_MAX_THREADS (256).
fn cubin(
    abi: u8,
    flags: u32,
    e_version: u32,
    machine: u16,
    names: &[&str],
    api: Option<u32>,
) -> Vec<u8> {
    let mut shstr = b"\0.shstrtab\0.strtab\0.symtab\0".to_vec();
    let mut strtab = vec![0u8];
    let mut symtab = vec![0u8; 24];
    let mut infos = Vec::new();
    for n in names {
        let name_off = strtab.len() as u32;
        strtab.extend_from_slice(n.as_bytes());
        strtab.push(0);
        let mut sym = name_off.to_le_bytes().to_vec();
        sym.extend_from_slice(&[0x12, 0x10, 0, 0]);
        sym.extend_from_slice(&[0u8; 16]);
        symtab.extend_from_slice(&sym);
        let section_name = shstr.len() as u32;
        shstr.extend_from_slice(format!(".nv.info.{n}\0").as_bytes());
        let mut info = Vec::new();
        if let Some(v) = api {
            info.extend_from_slice(&[4, 0x37, 4, 0]);
            info.extend_from_slice(&v.to_le_bytes());
        }
        info.extend_from_slice(&[4, 0x05, 12, 0]);
        for x in [256u32, 1, 1] {
            info.extend_from_slice(&x.to_le_bytes());
        }
        infos.push((section_name, info));
    }
    let mut body = Vec::new();
    let mut place = |data: &[u8]| {
        let off = 64 + body.len() as u64;
        body.extend_from_slice(data);
        while body.len() % 8 != 0 {
            body.push(0);
        }
        (off, data.len() as u64)
    };
    let shstr_at = place(&shstr);
    let str_at = place(&strtab);
    let sym_at = place(&symtab);
    let info_at: Vec<_> = infos.iter().map(|(n, d)| (*n, place(d))).collect();
    let shnum = 4 + info_at.len() as u16;
    let shoff = 64 + body.len() as u64;
    let mut elf = b"\x7fELF\x02\x01\x01".to_vec();
    elf.push(if abi == 7 { 0x33 } else { 0x41 });
    elf.push(abi);
    elf.extend_from_slice(&[0u8; 7]);
    elf.extend_from_slice(&2u16.to_le_bytes());
    elf.extend_from_slice(&machine.to_le_bytes());
    elf.extend_from_slice(&e_version.to_le_bytes());
    elf.extend_from_slice(&[0u8; 16]); // entry, phoff
    elf.extend_from_slice(&shoff.to_le_bytes());
    elf.extend_from_slice(&flags.to_le_bytes());
    for v in [64u16, 56, 0, 64, shnum, 1] {
        elf.extend_from_slice(&v.to_le_bytes());
    }
    elf.extend_from_slice(&body);
    section_header(&mut elf, 0, 0, 0, 0, 0);
    section_header(&mut elf, 1, 3, shstr_at.0, shstr_at.1, 0);
    section_header(&mut elf, 11, 3, str_at.0, str_at.1, 0);
    section_header(&mut elf, 19, 2, sym_at.0, sym_at.1, 2);
    for (name, (off, size)) in info_at {
        section_header(&mut elf, name, 0x7000_0000, off, size, 3);
    }
    elf
}

fn ptx(version: &str, target: &str, name: &str) -> Vec<u8> {
    format!(
        "//\n.version {version}\n.target {target}\n.address_size 64\n\n.visible .entry {name}(\n\t.param .u64 p0\n)\n.maxntid 256, 1, 1\n{{\n\tret;\n}}\n\0"
    )
    .into_bytes()
}

fn load(image: &[u8]) -> (CUresult, CUmodule) {
    let mut m = std::ptr::null_mut();
    // SAFETY: a complete image in memory.
    let r = unsafe { cuModuleLoadData(&mut m, image.as_ptr().cast()) };
    (r, m)
}

fn function(m: CUmodule, name: &str) -> (CUresult, CUfunction) {
    let mut f = std::ptr::null_mut();
    let c = CString::new(name).unwrap();
    // SAFETY: a module handle and a C string.
    let r = unsafe { cuModuleGetFunction(&mut f, m, c.as_ptr()) };
    (r, f)
}

const COPY: &str = "ncclReshardCopyKernel";

#[test]
fn cubins_load_only_for_a_runnable_architecture_and_toolkit() {
    use_device(0);
    let ok = CUresult::CUDA_SUCCESS;
    let no_binary = CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU;
    let invalid = CUresult::CUDA_ERROR_INVALID_IMAGE;
    // (abi, e_flags, e_version, machine, api version, expected) on the default sm_90, 12.9.
    let cases = [
        (7, 0x005a_055a, 129, 190, Some(129), ok, "NVRTC 12.9 sm_90"),
        (7, 0x005a_0d5a, 129, 190, Some(129), ok, "NVRTC 12.9 sm_90a"),
        (
            7,
            0x0050_0550,
            129,
            190,
            Some(129),
            no_binary,
            "sm_80 on an sm_90 device",
        ),
        (
            8,
            0x0600_6402,
            1,
            190,
            Some(129),
            no_binary,
            "NVRTC 12.9 sm_100",
        ),
        (
            8,
            0x0600_5a04,
            1,
            190,
            Some(135),
            invalid,
            "NVRTC 13.5 sm_90 on a 12.9 driver",
        ),
        (
            8,
            0x0600_5a04,
            1,
            190,
            Some(129),
            ok,
            "ABI 8 sm_90 from a 12.9 toolkit",
        ),
        (7, 0x005a_055a, 129, 62, Some(129), invalid, "an x86-64 ELF"),
        (
            9,
            0x0600_5a04,
            1,
            190,
            None,
            invalid,
            "an unknown CUDA ELF ABI",
        ),
    ];
    for (abi, flags, version, machine, api, want, what) in cases {
        let image = cubin(abi, flags, version, machine, &[COPY], api);
        assert_eq!(load(&image).0, want, "{what}");
    }
    assert_eq!(load(b"\xba\x55\xed\x50garbage\0").0, invalid, "a fatbin");
}

#[test]
fn older_minor_architectures_run_on_newer_devices_of_the_same_major() {
    if child().as_deref() != Some("sm86") {
        let out = run_child(
            "older_minor_architectures_run_on_newer_devices_of_the_same_major",
            "sm86",
            &[
                ("NCCL_RESHARD_EMU_SM", "86"),
                ("NCCL_RESHARD_EMU_DRIVER_VERSION", "12040"),
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    use_device(0);
    let cubin_for = |sm: u32| cubin(7, (sm << 16) | 0x0500 | sm, 124, 190, &[COPY], Some(124));
    assert_eq!(load(&cubin_for(80)).0, CUresult::CUDA_SUCCESS);
    assert_eq!(load(&cubin_for(86)).0, CUresult::CUDA_SUCCESS);
    assert_eq!(
        load(&cubin_for(89)).0,
        CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
    );
    assert_eq!(load(&ptx("8.4", "sm_80", COPY)).0, CUresult::CUDA_SUCCESS);
    assert_eq!(
        load(&ptx("8.5", "sm_80", COPY)).0,
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    );
}

#[test]
fn ptx_is_checked_against_the_driver_isa_and_the_device() {
    use_device(0);
    assert_eq!(load(&ptx("8.8", "sm_90", COPY)).0, CUresult::CUDA_SUCCESS);
    assert_eq!(
        load(&ptx("9.0", "sm_90", COPY)).0,
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    );
    assert_eq!(
        load(&ptx("8.8", "sm_100", COPY)).0,
        CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
    );
    assert_eq!(load(b"hello world\0").0, CUresult::CUDA_ERROR_INVALID_IMAGE);
}

#[test]
fn functions_exist_only_when_the_image_names_them() {
    use_device(0);
    let (r, m) = load(&cubin(
        7,
        0x005a_055a,
        129,
        190,
        &[COPY, "other"],
        Some(129),
    ));
    ck(r, "load");
    assert_eq!(function(m, "missing").0, CUresult::CUDA_ERROR_NOT_FOUND);
    let (r, f) = function(m, COPY);
    ck(r, "get function");
    let mut threads = 0;
    // SAFETY: a function handle.
    ck(
        unsafe { cuFuncGetAttribute(&mut threads, 0, f) },
        "attribute",
    );
    assert_eq!(threads, 256, "the launch bound comes from the image");
    // SAFETY: a module handle.
    ck(unsafe { cuModuleUnload(m) }, "unload");
    // SAFETY: the function's module is gone.
    assert_eq!(
        unsafe { cuFuncGetAttribute(&mut threads, 0, f) },
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
}

// ---- the copy kernel ----

/// kernels/copy.cu's `struct CopyDesc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CopyDesc {
    src_offset: u64,
    dst_offset: u64,
    chunk_bytes: u64,
    src_base: u32,
    dst_base: u32,
    ndims: u32,
    /// 0: a copy (the only kind these tests launch).
    kind: u32,
    count: [u64; 8],
    src_stride: [u64; 8],
    dst_stride: [u64; 8],
    block: [u64; 8],
    scale_stride: [u64; 8],
    scale_offset: u64,
    partials_offset: u64,
    divisors_offset: u64,
    blocks: u64,
    partials: u64,
    strip_groups: u64,
    row_chunks: u64,
    item_rows: u32,
    item_strips: u32,
    row_dim: u32,
    level: u32,
    scale_base: u32,
    work_base: u32,
    arith: u32,
    reserved: u32,
}

/// kernels/copy.cu's `struct Tile`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Tile {
    start: u64,
    bytes: u64,
    desc: u32,
    reserved: u32,
}

#[repr(C)]
struct Bases([u64; 384]);

fn as_bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data structs viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Loads the copy kernel from a PTX image (its name is all the emulator needs).
fn copy_kernel() -> CUfunction {
    let (r, m) = load(&ptx("8.0", "sm_80", COPY));
    ck(r, "load");
    let (r, f) = function(m, COPY);
    ck(r, "get function");
    f
}

fn launch(
    f: CUfunction,
    tiles: u32,
    threads: u32,
    descs: CUdeviceptr,
    tile_table: CUdeviceptr,
    bases: &Bases,
    s: CUstream,
) -> CUresult {
    // Every launch here covers two tiles (grid-stride: fewer blocks than tiles also work).
    let (mut d, mut t, mut first, mut count) = (descs, tile_table, 0u64, 2u64);
    let mut bases = Bases(bases.0);
    let mut params: [*mut c_void; 5] = [
        (&mut d as *mut u64).cast(),
        (&mut t as *mut u64).cast(),
        (&mut first as *mut u64).cast(),
        (&mut count as *mut u64).cast(),
        (&mut bases as *mut Bases).cast(),
    ];
    // SAFETY: the kernel's five parameters; values are copied at the call.
    unsafe {
        cuLaunchKernel(
            f,
            tiles,
            1,
            1,
            threads,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

/// A strided 2-D copy at odd offsets (byte edges, shifted 16-byte units) and a contiguous 4 KiB
/// copy (aligned 16-byte units).
fn descriptors() -> (Vec<CopyDesc>, Vec<Tile>) {
    let mut strided = CopyDesc {
        src_offset: 3,
        dst_offset: 1,
        chunk_bytes: 12,
        ndims: 2,
        src_base: 0,
        dst_base: 1,
        ..Default::default()
    };
    strided.count[..2].copy_from_slice(&[8, 5]);
    strided.src_stride[..2].copy_from_slice(&[100, 16]);
    strided.dst_stride[..2].copy_from_slice(&[60, 12]);
    let mut contiguous = CopyDesc {
        src_offset: 1024,
        dst_offset: 512,
        chunk_bytes: 4096,
        ndims: 1,
        src_base: 0,
        dst_base: 1,
        ..Default::default()
    };
    contiguous.count[0] = 1;
    let tiles = vec![
        Tile {
            start: 0,
            bytes: 480,
            desc: 0,
            reserved: 0,
        },
        Tile {
            start: 0,
            bytes: 4096,
            desc: 1,
            reserved: 0,
        },
    ];
    (vec![strided, contiguous], tiles)
}

/// The bytes each descriptor moves, computed independently of the kernel.
fn oracle(descs: &[CopyDesc], src: &[u8], dst: &mut [u8]) {
    for d in descs {
        let n = d.ndims as usize;
        let chunks: u64 = d.count[..n].iter().product();
        for c in 0..chunks {
            let (mut rest, mut s, mut t) = (c, d.src_offset, d.dst_offset);
            for k in (0..n).rev() {
                let i = rest % d.count[k];
                rest /= d.count[k];
                s += i * d.src_stride[k];
                t += i * d.dst_stride[k];
            }
            let b = d.chunk_bytes as usize;
            dst[t as usize..t as usize + b].copy_from_slice(&src[s as usize..s as usize + b]);
        }
    }
}

fn setup(device: i32, dst_bytes: usize) -> (CUstream, CUdeviceptr, CUdeviceptr, Vec<u8>, Vec<u8>) {
    use_device(device);
    let s = stream(1);
    let src: Vec<u8> = (0..8192u32).map(|i| (i * 31 + 7) as u8).collect();
    let dst = vec![0u8; dst_bytes];
    let (src_dev, dst_dev) = (alloc(src.len()), alloc(dst.len()));
    upload_async(src_dev, &src, s);
    upload_async(dst_dev, &dst, s);
    (s, src_dev, dst_dev, src, dst)
}

fn upload_tables(descs: &[CopyDesc], tiles: &[Tile], s: CUstream) -> (CUdeviceptr, CUdeviceptr) {
    let (d, t) = (alloc(as_bytes(descs).len()), alloc(as_bytes(tiles).len()));
    upload_async(d, as_bytes(descs), s);
    upload_async(t, as_bytes(tiles), s);
    (d, t)
}

#[test]
fn the_copy_kernel_moves_exactly_the_described_bytes() {
    let (s, src_dev, dst_dev, src, mut want) = setup(1, 4700);
    let f = copy_kernel();
    let (descs, tiles) = descriptors();
    let (d, t) = upload_tables(&descs, &tiles, s);
    let mut bases = Bases([0; 384]);
    bases.0[0] = src_dev;
    bases.0[1] = dst_dev;
    ck(launch(f, 2, 256, d, t, &bases, s), "launch");
    sync(s);
    oracle(&descs, &src, &mut want);
    assert_eq!(download(dst_dev, want.len()), want);
}

#[test]
fn launch_limits_and_contexts_are_checked() {
    let (s, src_dev, dst_dev, _, _) = setup(2, 4700);
    let f = copy_kernel();
    let (descs, tiles) = descriptors();
    let (d, t) = upload_tables(&descs, &tiles, s);
    let mut bases = Bases([0; 384]);
    bases.0[0] = src_dev;
    bases.0[1] = dst_dev;
    let invalid = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(
        launch(f, 2, 512, d, t, &bases, s),
        invalid,
        "above the launch bound"
    );
    assert_eq!(
        launch(f, 2, 2048, d, t, &bases, s),
        invalid,
        "above 1024 threads"
    );
    assert_eq!(launch(f, 0, 256, d, t, &bases, s), invalid, "an empty grid");
    // A stream of another context: the module is not loaded there.
    use_device(3);
    let other = stream(1);
    assert_eq!(
        launch(f, 2, 256, d, t, &bases, other),
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
}

#[test]
fn an_out_of_bounds_descriptor_is_caught_in_the_kernel() {
    if child().as_deref() == Some("oob-kernel") {
        let (s, src_dev, dst_dev, _, _) = setup(4, 4600);
        let f = copy_kernel();
        let (descs, tiles) = descriptors();
        let (d, t) = upload_tables(&descs, &tiles, s);
        let mut bases = Bases([0; 384]);
        bases.0[0] = src_dev;
        bases.0[1] = dst_dev;
        ck(launch(f, 2, 256, d, t, &bases, s), "launch");
        sync(s);
        return;
    }
    let out = run_child(
        "an_out_of_bounds_descriptor_is_caught_in_the_kernel",
        "oob-kernel",
        &[],
    );
    assert_aborts(
        &out,
        &[
            "kernel ncclReshardCopyKernel",
            "block (1, 0, 0) thread (",
            "write of 16 bytes",
            "out of bounds",
            "cuMemAlloc_v2 (4600 bytes)",
        ],
    );
}

#[test]
fn a_misaligned_access_is_caught_in_the_kernel() {
    // A GPU faults on an access not aligned to its size; so does the emulator. Here the
    // descriptor table starts 4 bytes into its allocation: the kernel reads its 8-byte fields
    // from a 4-byte aligned address.
    if child().as_deref() == Some("misaligned") {
        let (s, src_dev, dst_dev, _, _) = setup(4, 4700);
        let f = copy_kernel();
        let (descs, tiles) = descriptors();
        let mut shifted = vec![0u8; 4];
        shifted.extend_from_slice(as_bytes(&descs));
        let d = alloc(shifted.len());
        upload_async(d, &shifted, s);
        let (_, t) = upload_tables(&descs, &tiles, s);
        let mut bases = Bases([0; 384]);
        bases.0[0] = src_dev;
        bases.0[1] = dst_dev;
        ck(launch(f, 2, 256, d + 4, t, &bases, s), "launch");
        sync(s);
        return;
    }
    let out = run_child(
        "a_misaligned_access_is_caught_in_the_kernel",
        "misaligned",
        &[],
    );
    assert_aborts(
        &out,
        &[
            "kernel ncclReshardCopyKernel",
            "misaligned address",
            "8-byte alignment",
        ],
    );
}

#[test]
fn in_return_mode_a_kernel_fault_becomes_a_sticky_illegal_address() {
    if child().as_deref() == Some("sticky") {
        let (s, src_dev, dst_dev, _, _) = setup(4, 4600);
        let f = copy_kernel();
        let (descs, tiles) = descriptors();
        let (d, t) = upload_tables(&descs, &tiles, s);
        let mut bases = Bases([0; 384]);
        bases.0[0] = src_dev;
        bases.0[1] = dst_dev;
        ck(launch(f, 2, 256, d, t, &bases, s), "launch");
        // SAFETY: the stream and context of this test.
        unsafe {
            assert_eq!(cuStreamSynchronize(s), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(
                cuCtxSynchronize(),
                CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
                "sticky"
            );
            assert_eq!(cudaGetLastError(), 700);
            assert_eq!(cudaPeekAtLastError(), 700, "sticky errors stay");
        }
        println!("child done");
        return;
    }
    let out = run_child(
        "in_return_mode_a_kernel_fault_becomes_a_sticky_illegal_address",
        "sticky",
        &[("NCCL_RESHARD_EMU_ON_ERROR", "return")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("ERROR: kernel ncclReshardCopyKernel"),
        "{stderr}"
    );
}

#[test]
fn kernels_reach_only_their_own_devices_memory() {
    if child().as_deref() == Some("wrong-device") {
        let (_, src_dev, _, _, _) = setup(5, 4700);
        let (s, _, dst_dev, _, _) = setup(6, 4700);
        let f = copy_kernel();
        let (descs, tiles) = descriptors();
        let (d, t) = upload_tables(&descs, &tiles, s);
        let mut bases = Bases([0; 384]);
        bases.0[0] = src_dev;
        bases.0[1] = dst_dev;
        ck(launch(f, 2, 256, d, t, &bases, s), "launch");
        sync(s);
        return;
    }
    let out = run_child(
        "kernels_reach_only_their_own_devices_memory",
        "wrong-device",
        &[],
    );
    assert_aborts(&out, &["not on device 6", "device 5"]);
}

#[test]
fn launching_a_kernel_the_emulator_cannot_run_aborts() {
    if child().as_deref() == Some("other-kernel") {
        use_device(0);
        let (r, m) = load(&ptx("8.0", "sm_80", "someOtherKernel"));
        ck(r, "load");
        let (r, f) = function(m, "someOtherKernel");
        ck(r, "get function");
        let mut x = 0u64;
        let mut params: [*mut c_void; 1] = [(&mut x as *mut u64).cast()];
        // SAFETY: the launch under test aborts before reading parameters.
        unsafe {
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        return;
    }
    let out = run_child(
        "launching_a_kernel_the_emulator_cannot_run_aborts",
        "other-kernel",
        &[],
    );
    assert_aborts(
        &out,
        &["the emulator runs only ncclReshardCopyKernel, ncclReshardConvertKernel and ncclreshardLoopbackCopy"],
    );
}

// ---- NVRTC's own output ----

type Program = *mut c_void;

/// Compiles kernels/copy.cu with the NVRTC named by NCCL_RESHARD_NVRTC_LIBRARY.
fn nvrtc_cubin(library: &str, arch: &str) -> Vec<u8> {
    let path = CString::new(library).unwrap();
    // SAFETY: dlopen/dlsym of NVRTC with its documented C signatures.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!h.is_null(), "cannot open {library}");
        let sym = |n: &str| {
            let c = CString::new(n).unwrap();
            let p = libc::dlsym(h, c.as_ptr());
            assert!(!p.is_null(), "{n}");
            p
        };
        type Create = unsafe extern "C" fn(
            *mut Program,
            *const i8,
            *const i8,
            i32,
            *const *const i8,
            *const *const i8,
        ) -> i32;
        type Compile = unsafe extern "C" fn(Program, i32, *const *const i8) -> i32;
        type Size = unsafe extern "C" fn(Program, *mut usize) -> i32;
        type Fill = unsafe extern "C" fn(Program, *mut i8) -> i32;
        let create: Create = std::mem::transmute(sym("nvrtcCreateProgram"));
        let compile: Compile = std::mem::transmute(sym("nvrtcCompileProgram"));
        let size: Size = std::mem::transmute(sym("nvrtcGetCUBINSize"));
        let fill: Fill = std::mem::transmute(sym("nvrtcGetCUBIN"));
        let source = CString::new(include_str!("../../kernels/copy.cu")).unwrap();
        let mut prog = std::ptr::null_mut();
        assert_eq!(
            create(
                &mut prog,
                source.as_ptr(),
                c"copy.cu".as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            0
        );
        let opts = [
            CString::new(format!("--gpu-architecture={arch}")).unwrap(),
            CString::new("-std=c++17").unwrap(),
        ];
        let ptrs: Vec<*const i8> = opts.iter().map(|o| o.as_ptr()).collect();
        assert_eq!(
            compile(prog, 2, ptrs.as_ptr()),
            0,
            "NVRTC compile for {arch}"
        );
        let mut n = 0;
        assert_eq!(size(prog, &mut n), 0);
        let mut out = vec![0u8; n];
        assert_eq!(fill(prog, out.as_mut_ptr().cast()), 0);
        out
    }
}

#[test]
fn nvrtc_cubins_load_on_matching_devices_and_run() {
    let Ok(library) = std::env::var("NCCL_RESHARD_NVRTC_LIBRARY") else {
        println!(
            "skipped: set NCCL_RESHARD_NVRTC_LIBRARY to an NVRTC library to check NVRTC's cubins"
        );
        return;
    };
    let (s, src_dev, dst_dev, src, mut want) = setup(7, 4700);
    assert_eq!(
        load(&nvrtc_cubin(&library, "sm_80")).0,
        CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
    );
    assert_eq!(
        load(&nvrtc_cubin(&library, "sm_100")).0,
        CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
    );
    let (r, m) = load(&nvrtc_cubin(&library, "sm_90"));
    ck(r, "load NVRTC's sm_90 cubin");
    let (r, f) = function(m, COPY);
    ck(r, "get function");
    let (descs, tiles) = descriptors();
    let (d, t) = upload_tables(&descs, &tiles, s);
    let mut bases = Bases([0; 384]);
    bases.0[0] = src_dev;
    bases.0[1] = dst_dev;
    ck(launch(f, 2, 256, d, t, &bases, s), "launch");
    sync(s);
    oracle(&descs, &src, &mut want);
    assert_eq!(download(dst_dev, want.len()), want);
}

/// Launches the loopback stand-in's copy kernel: `bytes` from `src` to `dst` on `s`.
fn loopback_copy(dst: u64, src: u64, bytes: u64, s: CUstream) -> CUresult {
    let (r, m) = load(&ptx("7.0", "sm_70", "ncclreshardLoopbackCopy"));
    ck(r, "load");
    let (r, f) = function(m, "ncclreshardLoopbackCopy");
    ck(r, "get function");
    let (mut d, mut x, mut n) = (dst, src, bytes);
    let mut params: [*mut c_void; 3] = [
        (&mut d as *mut u64).cast(),
        (&mut x as *mut u64).cast(),
        (&mut n as *mut u64).cast(),
    ];
    // SAFETY: three u64 parameters, as the kernel takes.
    unsafe {
        cuLaunchKernel(
            f,
            4,
            1,
            1,
            256,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

#[test]
fn the_loopback_copy_kernel_copies_bytes_and_faults_outside_allocations() {
    if child().as_deref() == Some("loopback-out-of-range") {
        use_device(0);
        let s = stream(0);
        let (src, dst) = (alloc(100), alloc(100));
        ck(loopback_copy(dst, src, 101, s), "launch");
        sync(s);
        return;
    }
    use_device(0);
    let s = stream(0);
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
    let (src, dst) = (alloc(1000), alloc(1000));
    upload_async(src, &bytes, s);
    // Odd offsets and length: the byte path.
    ck(loopback_copy(dst + 1, src + 3, 995, s), "launch");
    sync(s);
    assert_eq!(download(dst + 1, 995), bytes[3..998]);
    let out = run_child(
        "the_loopback_copy_kernel_copies_bytes_and_faults_outside_allocations",
        "loopback-out-of-range",
        &[],
    );
    assert_aborts(&out, &["ncclreshardLoopbackCopy", "101 bytes"]);
}
