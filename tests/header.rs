//! `include/ncclReshard.h` is generated from `src/ffi/` by the pinned cbindgen and checked in.
//! This test regenerates it in memory and fails on any difference; with
//! `NCCL_RESHARD_REGENERATE_HEADER=1` it rewrites the file instead. The macros cbindgen cannot
//! express (versions from Cargo.toml, the magic in hex, the unset sentinel, the initialisers
//! from the tables in `src/ffi/types.rs`) are written here, and the initialisers are checked
//! against the structs cbindgen generated.

use ncclreshard::ffi::{
    InitializerField, CONFIG_INITIALIZER, LAYOUT_INITIALIZER, NCCL_RESHARD_CONFIG_MAGIC,
    NCCL_RESHARD_RANK_NONE, NCCL_RESHARD_UNDEF_INT, PLAN_INFO_INITIALIZER, QUANT_INITIALIZER,
    TENSOR_INITIALIZER, TRANSFER_INITIALIZER,
};
use std::path::Path;

/// The initialiser macros, each with the struct it initialises.
const INITIALIZERS: [(&str, &str, &[InitializerField]); 6] = [
    (
        "NCCL_RESHARD_LAYOUT_INITIALIZER",
        "ncclReshardLayout_t",
        LAYOUT_INITIALIZER,
    ),
    (
        "NCCL_RESHARD_TENSOR_INITIALIZER",
        "ncclReshardTensor_t",
        TENSOR_INITIALIZER,
    ),
    (
        "NCCL_RESHARD_QUANT_INITIALIZER",
        "ncclReshardQuant_t",
        QUANT_INITIALIZER,
    ),
    (
        "NCCL_RESHARD_CONFIG_INITIALIZER",
        "ncclReshardConfig_t",
        CONFIG_INITIALIZER,
    ),
    (
        "NCCL_RESHARD_PLAN_INFO_INITIALIZER",
        "ncclReshardPlanInfo_t",
        PLAN_INFO_INITIALIZER,
    ),
    (
        "NCCL_RESHARD_TRANSFER_INITIALIZER",
        "ncclReshardTransfer_t",
        TRANSFER_INITIALIZER,
    ),
];

/// One initialiser macro, NCCL style: one field per line with its comment.
fn initializer(macro_name: &str, fields: &[InitializerField]) -> String {
    let width = fields.iter().map(|f| f.value.len()).max().unwrap_or(0) + 1;
    let mut text = format!("#define {macro_name} {{ \\\n");
    for (i, f) in fields.iter().enumerate() {
        let value = format!("{}{}", f.value, if i + 1 < fields.len() { "," } else { "" });
        text.push_str(&format!(
            "  {value:<width$} /* {:<w2$} */ \\\n",
            f.comment,
            width = width + 1,
            w2 = fields.iter().map(|f| f.comment.len()).max().unwrap_or(0)
        ));
    }
    text.push_str("}\n");
    text
}

/// Text placed after the includes: macros cbindgen cannot express.
fn trailer() -> String {
    let v = |name: &str| std::env::var(name).expect("cargo sets the version variables");
    let (major, minor, patch) = (
        v("CARGO_PKG_VERSION_MAJOR"),
        v("CARGO_PKG_VERSION_MINOR"),
        v("CARGO_PKG_VERSION_PATCH"),
    );
    let mut text = format!(
        r#"
/** An NCCL_RESHARD_VERSION_CODE from its parts (like NCCL_VERSION). */
#define NCCL_RESHARD_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))

/** Library version this header belongs to (see ncclReshardGetVersion). */
#define NCCL_RESHARD_MAJOR {major}
#define NCCL_RESHARD_MINOR {minor}
#define NCCL_RESHARD_PATCH {patch}
#define NCCL_RESHARD_VERSION_CODE NCCL_RESHARD_VERSION(NCCL_RESHARD_MAJOR, NCCL_RESHARD_MINOR, NCCL_RESHARD_PATCH)

/** Identifies an initialised ncclReshardConfig_t ("RESH"). */
#define NCCL_RESHARD_CONFIG_MAGIC {NCCL_RESHARD_CONFIG_MAGIC:#010x}

/** An int field left unset (like NCCL_CONFIG_UNDEF_INT): the library resolves it to its
 *  default, or refuses a field that has none. */
#define NCCL_RESHARD_UNDEF_INT ({} - 1)

/** A mesh position whose rank is gone (ncclReshardLayout_t.ranks): its shard is held only by
 *  replicas elsewhere in the mesh, if any. */
#define NCCL_RESHARD_RANK_NONE ({})

/** Initialisers: start every struct from one, so that size, version and magic are set and
 *  tunables are left to the library's defaults. */
"#,
        NCCL_RESHARD_UNDEF_INT + 1,
        NCCL_RESHARD_RANK_NONE
    );
    for (name, _, fields) in INITIALIZERS {
        text.push_str(&initializer(name, fields));
    }
    text
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

/// The field names of `typedef struct { … } name;` in generated C, in order.
fn struct_fields(header: &str, name: &str) -> Vec<String> {
    let end = header
        .find(&format!("}} {name};"))
        .unwrap_or_else(|| panic!("{name} is not in the header"));
    let start = header[..end]
        .rfind("typedef struct {")
        .expect("struct start")
        + 16;
    header[start..end]
        .lines()
        .map(str::trim)
        .filter(|l| l.ends_with(';'))
        .map(|l| {
            let decl = l.trim_end_matches(';');
            let decl = decl.split('[').next().unwrap_or(decl);
            decl.rsplit([' ', '*']).next().unwrap_or(decl).to_string()
        })
        .collect()
}

#[test]
fn initializers_list_every_field_in_order() {
    let header = generate();
    for (macro_name, name, fields) in INITIALIZERS {
        let names: Vec<&str> = fields.iter().map(|f| f.name).collect();
        assert_eq!(
            names,
            struct_fields(&header, name),
            "{macro_name} and {name} disagree"
        );
    }
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
