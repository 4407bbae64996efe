//! Build script: gives the shared library its SONAME, derived from the crate version (the one
//! place the version lives): `libncclreshard.so.MAJOR`, or `.so.0.MINOR` while the major
//! version is 0 (0.x minor releases may change the ABI). Writes nothing outside OUT_DIR.

fn main() {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| "0".into());
    let (major, minor) = (
        var("CARGO_PKG_VERSION_MAJOR"),
        var("CARGO_PKG_VERSION_MINOR"),
    );
    let abi = if major == "0" {
        format!("0.{minor}")
    } else {
        major
    };
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libncclreshard.so.{abi}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
