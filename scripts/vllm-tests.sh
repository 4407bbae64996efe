#!/usr/bin/env bash
# The vLLM weight-transfer backend against real vLLM 0.33 models on CPU processes, part of the
# README's test command (scripts/test.sh):
#  - target/vllm-venv from scripts/vllm-venv.sh (made once, reused while its lock is unchanged);
#  - `pip install ./python` into it (the library builds with cargo, as in scripts/python-tests.sh;
#    the install registers the "ncclreshard" entry point vLLM loads its plugins from);
#  - pytest python/tests/test_vllm_backend.py (refits through vLLM's own weight-transfer API,
#    every parameter of every vLLM rank against load_weights; bad input on every rank) and
#    test_vllm_specs.py; NCCLRESHARD_VLLM_SWEEP=1 runs every model at TP 1/2/4 and EP 2/4 from
#    every source instead of the CI cases (38 cases, about 2.5 minutes);
#  - python/examples/vllm_refit.py --cpu, which must end with its "verified" line.
# Prints the seconds each part took.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$(date +%s)
py=$(bash scripts/vllm-venv.sh | tail -1)
t1=$(date +%s)

echo "== pip install ./python into target/vllm-venv"
"$py" -m pip install --quiet --disable-pip-version-check ./python
t2=$(date +%s)

echo "== pytest python/tests/test_vllm_backend.py python/tests/test_vllm_specs.py (real vLLM models on CPU)"
"$py" -m pytest -q -s -p no:cacheprovider python/tests/test_vllm_backend.py python/tests/test_vllm_specs.py
t3=$(date +%s)

echo "== python/examples/vllm_refit.py --cpu"
log=$(mktemp)
status=0
"$py" python/examples/vllm_refit.py --cpu >"$log" 2>&1 || status=$?
grep -v -e '^W[0-9]' -e 'triton' -e 'Triton' "$log" || true
[ "$status" -eq 0 ] && grep -q 'verified' "$log"
rm -f "$log"
t4=$(date +%s)
echo "== vLLM tests: venv $((t1 - t0)) s, install $((t2 - t1)) s, pytest $((t3 - t2)) s, example $((t4 - t3)) s"
