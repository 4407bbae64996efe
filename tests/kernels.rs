//! The embedded copy kernel compiles with the real NVRTC, with only the architecture and
//! `-std=c++17` as options, for the GPUs users run (A100, H100/H200, B200), without a warning.
//! No GPU needed: NVRTC is a compiler library.

use ncclreshard::exec::cuda::nvrtc;

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.12): scripts/native-tests.sh runs it with the nvidia-cuda-nvrtc-cu12 wheel via NCCL_RESHARD_NVRTC_LIBRARY"]
fn copy_kernel_compiles_for_sm80_sm90_sm100_without_warnings() {
    for (major, minor) in [(8, 0), (9, 0), (10, 0)] {
        let compiled =
            nvrtc::compile(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
        assert!(
            compiled.log.is_empty(),
            "sm_{major}{minor}: NVRTC said:\n{}",
            compiled.log
        );
        assert_eq!(
            &compiled.image[..4],
            b"\x7fELF",
            "sm_{major}{minor}: not a cubin"
        );
        assert!(nvrtc::KERNEL_SOURCE.contains(nvrtc::KERNEL_NAME));
    }
}

#[test]
fn a_missing_nvrtc_is_an_error_not_a_crash() {
    if std::env::var_os("NCCL_RESHARD_NVRTC_LIBRARY").is_some() {
        return; // the ignored test above covers the present case
    }
    // Without NVRTC on the loader's path, compiling is a clean error (never a panic); with
    // one, it compiles.
    match nvrtc::compile(9, 0) {
        Ok(compiled) => assert_eq!(&compiled.image[..4], b"\x7fELF"),
        Err(err) => assert!(err.message.contains("NVRTC was not found"), "{err}"),
    }
}
