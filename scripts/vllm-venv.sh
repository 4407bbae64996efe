#!/usr/bin/env bash
# target/vllm-venv: vLLM 0.33 on CPU, to build real vLLM models in CPU processes and use vLLM's own
# load_weights as the oracle (python/tests/vllm_harness.py). Needs only python3 (3.11 to 3.14,
# as vllm 0.33 requires) with venv and pip, and a package index that pip reaches.
#  - installs scripts/requirements-vllm.txt with --no-deps: the file is a complete lock, and
#    vllm's own metadata requires GPU-only packages a CPU build never imports;
#  - reuses the venv while the requirements file is unchanged (it is about 6 GB, mostly torch's
#    CUDA runtime wheels, which torch loads at import even without a GPU);
#  - checks that `import vllm` and vLLM's model and weight-transfer modules import with
#    VLLM_TARGET_DEVICE=cpu.
# Prints the venv's python on its last line, for callers: py=$(scripts/vllm-venv.sh | tail -1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/target/vllm-venv"
requirements="$root/scripts/requirements-vllm.txt"
stamp="$venv/.requirements"

if ! cmp -s "$requirements" "$stamp" 2>/dev/null; then
  echo "== installing vLLM and a CPU-usable torch into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  count=$(grep -c '^[A-Za-z]' "$requirements")
  start=$(date +%s)
  nice -n 10 bash -c 'source "$1"; shift; pip_install "$@"' _ "$root/scripts/pip-retry.sh" \
    "$venv/bin/python" --quiet --no-deps -r "$requirements" >&2
  echo "== $count packages in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1) on disk" >&2
  install_done=1
else
  install_done=0
fi

VLLM_TARGET_DEVICE=cpu nice -n 10 "$venv/bin/python" - >&2 <<'EOF'
import importlib, sys

import vllm

# What the harness and a weight-transfer backend touch: vLLM's config, distributed state, model
# construction, the models of the tiny configs, and the weight-transfer package.
for module in (
    "vllm.config",
    "vllm.distributed",
    "vllm.distributed.weight_transfer",
    "vllm.distributed.weight_transfer.m2n_layout",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.models.qwen2_moe",
):
    importlib.import_module(module)
from vllm.platforms import current_platform

if not current_platform.is_cpu():
    sys.exit(f"vLLM chose the {current_platform.device_name} platform, not the CPU")
print(f"== vllm {vllm.__version__} imports on the CPU platform")
EOF

# Stamped only after the import check, so a venv that cannot import vLLM is rebuilt next time.
if [ "$install_done" = 1 ]; then
  cp "$requirements" "$stamp"
fi
echo "$venv/bin/python"
