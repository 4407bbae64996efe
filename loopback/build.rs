//! The stand-in is loaded as NCCL: its SONAME is NCCL's, so a program linked against libnccl
//! and `dlopen("libnccl.so.2")` both take it once scripts/build-loopback.sh has copied it there.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}
