#!/usr/bin/env bash
# Builds the CUDA/NCCL emulator (emu/, docs/design.md §7.6) and assembles target/emu/lib/:
#   libncclreshard-emu-runtime.so  the emulator (driver API, cudart subset, NCCL in one library)
#   libcuda.so.1  (libcuda.so)     shims: empty libraries with the real SONAMEs whose only
#   libcudart.so.12 (libcudart.so) content is a DT_NEEDED on libncclreshard-emu-runtime.so, so
#   libnccl.so.2  (libnccl.so)     that dlopen/dlsym and programs linked against the real
#                                  libraries find the emulator's functions through them.
# The emulator is copied under a name of its own: cargo puts its own builds of the crate
# (target/debug/deps/libncclreshard_emu.so) on LD_LIBRARY_PATH when it runs tests, and the
# loader would pick such a stale build over the shims' $ORIGIN.
# Use: LD_LIBRARY_PATH=target/emu/lib <program>   (or NCCL_RESHARD_NCCL_LIBRARY=.../libnccl.so.2)
# Prints the directory at the end. Needs the Rust toolchain and gcc only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
out="$target/emu/lib"

cargo build --release --locked -p ncclreshard-emu --manifest-path "$root/Cargo.toml" >&2

rm -rf "$out"
mkdir -p "$out"
cp "$target/release/libncclreshard_emu.so" "$out/libncclreshard-emu-runtime.so"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: > "$work/empty.c"
# libcudart.so.12 defines the version node its users' symbol references name
# (cudaMalloc@libcudart.so.12); libnccl.so.2 and libcuda.so.1 have no symbol versions.
printf 'libcudart.so.12 { local: *; };\n' > "$work/cudart.map"

shim() {
  local soname=$1 link=$2
  shift 2
  gcc -shared -fPIC -o "$out/$soname" "$work/empty.c" -Wl,-soname,"$soname" "$@" \
    -Wl,--no-as-needed -L"$out" -l:libncclreshard-emu-runtime.so -Wl,-rpath,'$ORIGIN'
  ln -sf "$soname" "$out/$link"
}
shim libcuda.so.1 libcuda.so
shim libcudart.so.12 libcudart.so -Wl,--version-script="$work/cudart.map"
shim libnccl.so.2 libnccl.so

echo "$out"
