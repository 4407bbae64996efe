"""The package's hand-written ctypes structs (ncclreshard/_lib.py) against include/ncclReshard.h.

The package passes ``size = ctypes.sizeof(...)`` and the library reads every field at the
header's offset, so a struct that drifts from the header is read wrong without any error. A C
program compiled against the real header prints each struct's sizeof and each field's offset
and size; they must equal what ctypes computes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
# nccl.h, cuda_runtime.h, and the crt/ and nv/ that the wheel's cuda_runtime.h includes.
WHEELS = ("nccl", "cuda_runtime", "cuda_nvcc", "cuda_cccl")


def _lib_source() -> ModuleType:
    # The tree's _lib.py by path, not `import ncclreshard._lib`: the package imports torch, and
    # an installed copy may be older than the header it is checked against.
    path = REPO / "python" / "ncclreshard" / "_lib.py"
    spec = importlib.util.spec_from_file_location("_ncclreshard_lib_source", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _include_dirs() -> List[Path]:
    """NCCL_RESHARD_NATIVE_INCLUDE (dirs joined by ':', e.g. a CUDA toolkit's and NCCL's), else
    the NVIDIA wheels scripts/native-tests.sh installs into target/native-venv."""
    override = os.environ.get("NCCL_RESHARD_NATIVE_INCLUDE")
    if override:
        return [Path(d) for d in override.split(os.pathsep) if d]
    found = sorted((REPO / "target" / "native-venv").glob("lib/python3*/site-packages/nvidia"))
    dirs = [found[0] / wheel / "include" for wheel in WHEELS] if found else []
    if not dirs or not all(d.is_dir() for d in dirs):
        pytest.fail(
            "the NVIDIA headers ncclReshard.h includes are not in target/native-venv: run "
            "scripts/native-tests.sh first, or set NCCL_RESHARD_NATIVE_INCLUDE"
        )
    return dirs


def _header_fields(header: str, c_name: str) -> List[str]:
    """The field names of `typedef struct { ... } c_name;` in the generated header (one
    declaration per line, as cbindgen writes them)."""
    end = header.index("} " + c_name + ";")
    start = header.rindex("typedef struct {", 0, end) + len("typedef struct {")
    fields = []
    for line in header[start:end].splitlines():
        line = line.strip()
        if line.endswith(";"):
            declaration = line[:-1].split("[")[0]
            fields.append(declaration.replace("*", " ").split()[-1])
    return fields


def test_ctypes_structs_match_header(tmp_path: Path) -> None:
    module = _lib_source()
    structs = [
        value for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, ctypes.Structure)
        and value.__module__ == module.__name__
    ]
    assert structs, "no ctypes.Structure found in _lib.py: the enumeration is broken"

    # Tensor_t is ncclReshardTensor_t: a class that breaks the rule fails to compile below.
    expected: Dict[str, Tuple[int, ...]] = {}
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "ncclReshard.h"', "int main(void) {"]
    for struct in structs:
        c_name = "ncclReshard" + struct.__name__
        expected[c_name] = (ctypes.sizeof(struct),)
        lines.append(f'  printf("{c_name} %zu\\n", sizeof({c_name}));')
        for field, *_ in struct._fields_:
            descriptor = getattr(struct, field)
            expected[f"{c_name}.{field}"] = (descriptor.offset, descriptor.size)
            lines.append(
                f'  printf("{c_name}.{field} %zu %zu\\n", offsetof({c_name}, {field}), '
                f"sizeof((({c_name} *)0)->{field}));"
            )
    lines += ["  return 0;", "}"]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")

    gcc = shutil.which("gcc")
    assert gcc, "gcc not found on PATH"
    includes = [f"-I{d}" for d in [REPO / "include", *_include_dirs()]]
    program = tmp_path / "layout"
    compiled = subprocess.run(
        [gcc, "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", *includes, str(source),
         "-o", str(program)],
        capture_output=True, text=True,
    )
    assert compiled.returncode == 0, f"the layout program does not compile:\n{compiled.stderr}"
    ran = subprocess.run([str(program)], capture_output=True, text=True, check=True)
    actual = {name: tuple(int(v) for v in values)
              for name, *values in (line.split() for line in ran.stdout.splitlines())}

    mismatches = [
        f"{name}: header {actual.get(name)}, ctypes {want}"
        for name, want in expected.items() if actual.get(name) != want
    ]
    # A trailing field the package lacks can hide in padding (sizeof unchanged) and would be
    # read as 0: the field lists must be the header's, in order.
    header = (REPO / "include" / "ncclReshard.h").read_text()
    for struct in structs:
        c_name = "ncclReshard" + struct.__name__
        declared = [field for field, *_ in struct._fields_]
        if declared != _header_fields(header, c_name):
            mismatches.append(
                f"{c_name}: fields {declared}, header {_header_fields(header, c_name)}"
            )
    if mismatches:
        pytest.fail(
            "ctypes structs differ from include/ncclReshard.h ((sizeof), (offset, size) or fields):\n  "
            + "\n  ".join(mismatches)
        )
