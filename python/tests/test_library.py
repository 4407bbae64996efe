"""Which libncclreshard the package loads: the wheel's copy, or NCCL_RESHARD_LIBRARY."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ncclreshard as nr
from ncclreshard import _lib

from conftest import REPO


def _run(code: str, library: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NCCL_RESHARD_LIBRARY=library)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_wheel_carries_the_library() -> None:
    path = nr.library_path()
    assert path.name == "libncclreshard.so" and path.parent.name == "lib"
    assert path.parent.parent == Path(nr.__file__).parent
    assert _lib.lib().library_version_code == _lib.lib().struct_version  # built together


def test_nccl_reshard_library_overrides_it() -> None:
    built = REPO / "target" / "release" / "libncclreshard.so"
    result = _run("import ncclreshard as nr; print(nr.library_path()); "
                  "print(nr.local_shape(nr.Layout([2], 0, [nr.Shard(0)]), (5,), 1))", str(built))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(built), "(2,)"]
    missing = _run("import ncclreshard as nr; nr.local_shape(nr.Layout([1], 0, [nr.Replicate()]), (1,), 0)",
                   "/nonexistent/libncclreshard.so")
    assert missing.returncode != 0
    assert "libncclreshard not found at /nonexistent/libncclreshard.so" in missing.stderr
