//! The embedded copy and conversion kernels compile with the real NVRTC, with only the
//! architecture and `-std=c++17` as options, for the GPUs users run (A100, H100/H200, B200),
//! without a warning. No GPU needed: NVRTC is a compiler library.

use ncclreshard::gpu::nvrtc;

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
        for name in [nvrtc::KERNEL_NAME, nvrtc::CONVERT_KERNEL_NAME] {
            assert!(
                compiled
                    .image
                    .windows(name.len())
                    .any(|w| w == name.as_bytes()),
                "sm_{major}{minor}: no {name} in the cubin"
            );
        }
    }
}

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.12): scripts/native-tests.sh runs it with the nvidia-cuda-nvrtc-cu12 wheel via NCCL_RESHARD_NVRTC_LIBRARY"]
fn fp8_conversions_are_native_from_sm89_and_exact_software_before() {
    // docs/quantization.md §5: sm_89 and newer convert to FP8 with cvt.rn.satfinite; sm_80
    // has no FP8 instructions and runs the software path (the one the emulator runs). The
    // divisions are IEEE (div.rn), never the approximate forms, and nothing flushes
    // subnormals: the bits must equal the host executor's.
    for (major, minor, native) in [(8, 0, false), (8, 9, true), (9, 0, true), (10, 0, true)] {
        let compiled = nvrtc::compile_ptx(major, minor)
            .unwrap_or_else(|e| panic!("compute_{major}{minor}: {e}"));
        assert!(
            compiled.log.is_empty(),
            "compute_{major}{minor}: {}",
            compiled.log
        );
        let ptx = String::from_utf8_lossy(&compiled.image);
        for instruction in ["cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32"] {
            assert_eq!(
                ptx.contains(instruction),
                native,
                "compute_{major}{minor}: {instruction}"
            );
        }
        // Both halves of each pair: bfloat16 and float16 pairs from sm_80 on, and the copy
        // kernel's misaligned rows as funnel shifts of 16-byte words (ld/st .v4.u32).
        for instruction in [
            "cvt.rn.bf16x2.f32",
            "cvt.rn.f16x2.f32",
            "shf.r.wrap.b32",
            "ld.v4.u32",
            "st.v4.u32",
        ] {
            assert!(
                ptx.contains(instruction),
                "compute_{major}{minor}: {instruction}"
            );
        }
        assert!(
            ptx.contains("div.rn.f32"),
            "compute_{major}{minor}: IEEE division"
        );
        for approximate in ["div.full.f32", "div.approx", ".ftz"] {
            assert!(
                !ptx.contains(approximate),
                "compute_{major}{minor}: {approximate}"
            );
        }
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
