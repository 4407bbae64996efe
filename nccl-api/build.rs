//! Compiles `shim/group_depth.c`: the doubles' group depth as NCCL keeps its own (a hidden
//! thread-local `int ncclGroupDepth`), linked into both NCCL doubles.

fn main() {
    println!("cargo:rerun-if-changed=shim/group_depth.c");
    cc::Build::new()
        .file("shim/group_depth.c")
        .warnings_into_errors(true)
        .compile("ncclreshard_nccl_api_group_depth");
}
