//! Compiles `kernels/copy.cu` for the host: `shim/copy_kernel.cpp` defines the CUDA built-ins the
//! kernel uses (shim/cuda_host.h) and then includes the real kernel source, so the emulator runs
//! the very code NVRTC compiles for GPUs.

fn main() {
    println!("cargo:rerun-if-changed=shim/cuda_host.h");
    println!("cargo:rerun-if-changed=shim/copy_kernel.cpp");
    println!("cargo:rerun-if-changed=../kernels/copy.cu");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("shim/copy_kernel.cpp")
        .flag_if_supported("-fno-exceptions")
        .flag_if_supported("-fno-rtti")
        // `#pragma unroll` is a CUDA hint with no host meaning.
        .flag_if_supported("-Wno-unknown-pragmas")
        // GCC cannot see that v[j] is only read where the loop above wrote it (`j < have`).
        .flag_if_supported("-Wno-maybe-uninitialized")
        .warnings_into_errors(true)
        .compile("ncclreshard_emu_copy_kernel");
    // The shims in target/emu/lib name this in their DT_NEEDED; scripts/build-emulator.sh copies
    // the library to that name, which none of cargo's own outputs has (cargo puts
    // target/*/deps on LD_LIBRARY_PATH when it runs tests).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libncclreshard-emu-runtime.so");
}
