//! `include/ncclReshard.h` is generated from `src/ffi/` by the pinned cbindgen and checked in.
//! This test regenerates it in memory and fails on any difference; with
//! `NCCL_RESHARD_REGENERATE_HEADER=1` it rewrites the file instead.

use std::path::Path;

/// Text placed after the includes: macros cbindgen cannot express (versions derived from
/// Cargo.toml, initialisers).
fn trailer() -> String {
    let v = |name: &str| std::env::var(name).expect("cargo sets the version variables");
    let (major, minor, patch) = (
        v("CARGO_PKG_VERSION_MAJOR"),
        v("CARGO_PKG_VERSION_MINOR"),
        v("CARGO_PKG_VERSION_PATCH"),
    );
    format!(
        r#"
/** Library version this header belongs to (see ncclReshardGetVersion). */
#define NCCL_RESHARD_MAJOR {major}
#define NCCL_RESHARD_MINOR {minor}
#define NCCL_RESHARD_PATCH {patch}
#define NCCL_RESHARD_VERSION_CODE (NCCL_RESHARD_MAJOR * 10000 + NCCL_RESHARD_MINOR * 100 + NCCL_RESHARD_PATCH)

/** Initialisers: every versioned struct must start from one, so size/version/magic are set. */
#define NCCL_RESHARD_LAYOUT_INITIALIZER {{ sizeof(ncclReshardLayout_t), NCCL_RESHARD_VERSION_CODE, 0, {{0}}, NULL, 0, {{{{0, 0, 0}}}}, NULL }}
#define NCCL_RESHARD_TENSOR_INITIALIZER {{ sizeof(ncclReshardTensor_t), NCCL_RESHARD_VERSION_CODE, 0, {{0}}, ncclFloat32, NULL, NULL, 0, 0, NULL }}
#define NCCL_RESHARD_CONFIG_INITIALIZER {{ sizeof(ncclReshardConfig_t), NCCL_RESHARD_CONFIG_MAGIC, NCCL_RESHARD_VERSION_CODE, ncclReshardModeAuto, 0, NULL, 0, 0, 0, 0, 1 }}
#define NCCL_RESHARD_PLAN_INFO_INITIALIZER {{ sizeof(ncclReshardPlanInfo_t), NCCL_RESHARD_VERSION_CODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }}
#define NCCL_RESHARD_TRANSFER_INITIALIZER {{ sizeof(ncclReshardTransfer_t), NCCL_RESHARD_VERSION_CODE, 0, 0, 0, 0, {{0}}, {{0}}, 0, 0, 0, 0, {{0}}, {{0}}, {{0}}, 0, 0, ncclReshardViewSource, 0, 0 }}
"#
    )
}

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/ffi/mod.rs"))
        .with_src(root.join("src/ffi/types.rs"))
        .with_after_include(trailer())
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

#[test]
fn checked_in_header_matches_the_sources() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/ncclReshard.h");
    let generated = generate();
    if std::env::var_os("NCCL_RESHARD_REGENERATE_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("write include/ncclReshard.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/ncclReshard.h is stale: regenerate it with NCCL_RESHARD_REGENERATE_HEADER=1 cargo test --test header"
    );
}
