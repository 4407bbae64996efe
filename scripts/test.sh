#!/usr/bin/env bash
# The project's test command (README): formatting, lints, API docs, every Rust test (unit,
# property, end to end on the host executor, CLI, header drift), the native side (NVRTC kernels,
# C ABI, CMake package, examples), then the GPU tests and the refit example on 8 emulated GPUs, then
# the Python package (scripts/python-tests.sh), then the vLLM backend against real vLLM models on
# CPU processes (scripts/vllm-tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The library's API docs: every intra-doc link resolves and none points at a private item.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked -p ncclreshard
cargo test --workspace --locked
bash scripts/native-tests.sh
bash scripts/emulated-gpu-tests.sh
bash scripts/python-tests.sh
bash scripts/vllm-tests.sh
