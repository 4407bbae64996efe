#!/usr/bin/env bash
# Builds the loopback NCCL stand-in (loopback/, loopback/README.md): a test-only libnccl that
# runs the ranks of a communicator as threads on one GPU, never linked into libncclreshard.
#   bash scripts/build-loopback.sh [OUT_DIR]     (default target/loopback/lib)
# puts it into OUT_DIR as libnccl.so.2 (its SONAME) with the symlink libnccl.so, and prints
# OUT_DIR. Point NCCL_RESHARD_NCCL_LIBRARY at OUT_DIR/libnccl.so.2 (or put OUT_DIR first on
# LD_LIBRARY_PATH); it loads libcuda.so.1 at run time: the real driver, or the emulator's
# (target/emu/lib on LD_LIBRARY_PATH). Needs the Rust toolchain and gcc only; the result needs
# only libc and a CUDA driver, so it can be copied to a GPU machine without cargo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
out=${1:-$target/loopback/lib}

cargo build --release --locked -p ncclreshard-loopback --manifest-path "$root/Cargo.toml" >&2

mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out/libnccl.so.2" "$out/libnccl.so"
cp "$target/release/libncclreshard_loopback.so" "$out/libnccl.so.2"
ln -s libnccl.so.2 "$out/libnccl.so"
echo "$out"
