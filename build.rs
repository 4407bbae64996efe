//! Build script: gives the shared library its SONAME (derived from the crate version, the one
//! place the version lives). Writes nothing outside OUT_DIR.

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libncclreshard.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
