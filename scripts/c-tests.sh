#!/usr/bin/env bash
# The C side of the tests (DESIGN §7.3–7.4): builds the library through the top-level CMake
# project, runs its ctest suite (header as C11/C++17 with -Werror against the real nccl.h, the
# C API test plain / ASan+UBSan / valgrind / static, exported symbols and SONAME), installs it
# into a prefix, then builds and runs examples/c against the *installed* package.
# cmake and the NVIDIA header wheels are installed into a venv under target/ on first use.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/target/c-venv"
stamp="$venv/.requirements"
if ! cmp -s "$root/scripts/requirements-c.txt" "$stamp" 2>/dev/null; then
  echo "== installing cmake and NVIDIA header wheels into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$root/scripts/requirements-c.txt"
  cp "$root/scripts/requirements-c.txt" "$stamp"
fi
export PATH="$venv/bin:$PATH"

build="$root/target/c-build"
prefix="$root/target/c-prefix"
examples="$root/target/c-examples"
echo "== cmake: configure, build, ctest"
cmake -S "$root" -B "$build" -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j 2
ctest --test-dir "$build" --output-on-failure

echo "== cmake: install, then build examples/c against the installed package"
rm -rf "$prefix" "$examples"
cmake --install "$build"
cmake -S "$root/examples/c" -B "$examples" -DCMAKE_PREFIX_PATH="$prefix"
cmake --build "$examples" -j 2
ctest --test-dir "$examples" --output-on-failure
