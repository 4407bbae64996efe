#!/usr/bin/env bash
# GPU checks (docs/design.md §7.7) for a machine with a CUDA GPU, its driver, NCCL and NVRTC.
#
#   bash scripts/gpu-check.sh            build (when cargo is here) and run the GPU tests
#   bash scripts/gpu-check.sh --prepare  only build the test binary into .gpu/ (for a GPU
#                                        machine without a Rust toolchain: copy .gpu/ there)
#
# NCCL and NVRTC are found through NCCL_RESHARD_NCCL_LIBRARY / NCCL_RESHARD_NVRTC_LIBRARY, else
# in the NVIDIA Python wheels of the python3 on PATH (PyTorch ships both), else on the loader's
# path. Prints `gpu: …` report lines: byte checks (local copies and NCCL self send/receive on
# one GPU, every mode; multi-rank reshards when several GPUs are visible), plans inside a
# caller's NCCL group (groupable twice, staged refused), CUDA graph capture and replay,
# concurrent calls, a nonblocking communicator, the copy kernel's paths on every row length and
# alignment, conversions against the host executor on every bf16/f16 pattern (the hardware's
# cvt), and copy- and conversion-kernel bandwidth against cudaMemcpy / cuMemcpy2DAsync, each
# beside its target. Runs in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.gpu/gpu-tests

build() {
  mkdir -p .gpu
  local exe
  exe=$(cargo test --release --locked --test gpu --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
  cp "$exe" "$bin"
  echo "built $bin"
}

if [ "${1:-}" = "--prepare" ]; then
  build
  exit 0
fi
if command -v cargo >/dev/null 2>&1; then
  build
fi
[ -x "$bin" ] || { echo "no $bin: run scripts/gpu-check.sh --prepare on a machine with cargo"; exit 2; }

find_lib() { # $1: file name pattern
  python3 - "$1" <<'PY' 2>/dev/null || true
import glob, os, sys
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
roots += ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]
for root in roots:
    hits = sorted(glob.glob(os.path.join(root, "**", sys.argv[1]), recursive=True), reverse=True)
    if hits:
        print(hits[0])
        break
PY
}
export NCCL_RESHARD_NCCL_LIBRARY="${NCCL_RESHARD_NCCL_LIBRARY:-$(find_lib 'libnccl.so.2')}"
export NCCL_RESHARD_NVRTC_LIBRARY="${NCCL_RESHARD_NVRTC_LIBRARY:-$(find_lib 'libnvrtc.so.1[0-9]')}"
echo "NCCL:  ${NCCL_RESHARD_NCCL_LIBRARY:-(loader path)}"
echo "NVRTC: ${NCCL_RESHARD_NVRTC_LIBRARY:-(loader path)}"
[ -n "$NCCL_RESHARD_NCCL_LIBRARY" ] || unset NCCL_RESHARD_NCCL_LIBRARY
[ -n "$NCCL_RESHARD_NVRTC_LIBRARY" ] || unset NCCL_RESHARD_NVRTC_LIBRARY
nvidia-smi -L 2>/dev/null || true

log=$(mktemp)
status=0
timeout 420 "$bin" --ignored --nocapture --test-threads=1 2>&1 | tee "$log" || status=$?
echo
echo "== GPU report"
grep -o 'gpu: .*' "$log" || true
grep -E '^test result|panicked|FAILED' "$log" || true
exit "$status"
