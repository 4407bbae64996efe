"""The one-NCCL-per-process rule, in fresh processes with torch's own libnccl (the NVIDIA wheel
PyTorch depends on): the library uses the NCCL already mapped in the process — loaded
RTLD_LOCAL, as Python loads torch's and vLLM's — and refuses to map a second copy beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Optional

import pytest


def _python(code: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop("NCCL_RESHARD_NCCL_LIBRARY", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=120)


@pytest.fixture(scope="module")
def torch_nccl() -> Path:
    """The libnccl file `import torch` maps."""
    found = _python("""
        import torch
        maps = [l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l.split()[-1]]
        print(maps[0] if maps else '')
    """)
    assert found.returncode == 0, found.stderr
    if not found.stdout.strip():
        pytest.skip("this torch build maps no libnccl (a CPU-only build)")
    return Path(found.stdout.strip()).resolve()


REPORT = """
    import ctypes, os, sys
    {before}
    import ncclreshard as nr
    from ncclreshard import nccl
    try:
        found = nr.nccl_library()
    except nr.NcclReshardError as e:
        print("ERROR", e)
        sys.exit(0)
    print("PATH", os.path.realpath(found.path))
    print("VERSION", found.version)
    print("SAME", {same})
"""


def _report(before: str = "", same: str = "None", env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    result = _python(REPORT.format(before=before, same=same), env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    out["stderr"] = result.stderr
    return out


def test_torch_s_nccl_is_the_one_used(torch_nccl: Path) -> None:
    got = _report(same="nccl.is_same_nccl(ctypes.CDLL(os.path.join(os.path.dirname(__import__('torch').__file__), 'lib', 'libtorch_cuda.so')))")
    assert got.get("PATH") == str(torch_nccl), got
    assert int(got["VERSION"]) >= 21800
    assert got["SAME"] == "True"  # torch's libtorch_cuda resolves ncclSend to the same function


def test_a_libnccl_loaded_rtld_local_first_is_that_same_one(torch_nccl: Path) -> None:
    before = f"mine = ctypes.CDLL({str(torch_nccl)!r}, mode=os.RTLD_LOCAL)"
    got = _report(before, same="nccl.function_address(mine) == nccl.function_address(nccl.cdll())")
    assert got.get("PATH") == str(torch_nccl), got
    assert got["SAME"] == "True"


def test_the_variable_naming_the_mapped_file_is_accepted(torch_nccl: Path, tmp_path: Path) -> None:
    link = tmp_path / "libnccl.so.2"
    link.symlink_to(torch_nccl)
    got = _report(env={"NCCL_RESHARD_NCCL_LIBRARY": str(link)})
    assert got.get("PATH") == str(torch_nccl), got


def test_a_second_copy_beside_the_mapped_one_is_refused(torch_nccl: Path, tmp_path: Path) -> None:
    copy = tmp_path / "other" / "libnccl.so.2"
    copy.parent.mkdir()
    shutil.copy2(torch_nccl, copy)
    got = _report(env={"NCCL_RESHARD_NCCL_LIBRARY": str(copy)})
    error = got.get("ERROR", "")
    assert "ncclSystemError" in error and "would map a second NCCL" in error, got
    assert str(copy) in error and torch_nccl.name in error
    # Two private copies: which one a communicator belongs to cannot be known.
    got = _report(f"ctypes.CDLL({str(copy)!r}, mode=os.RTLD_LOCAL)")
    assert "2 NCCLs are mapped in this process" in got.get("ERROR", ""), got
    assert "set NCCL_RESHARD_NCCL_LIBRARY" in got["ERROR"]
    # ...unless the variable picks the one whose communicators are passed.
    got = _report(f"ctypes.CDLL({str(copy)!r}, mode=os.RTLD_LOCAL)",
                  env={"NCCL_RESHARD_NCCL_LIBRARY": str(copy)})
    assert got.get("PATH") == str(copy.resolve()), got


def test_debug_info_reports_the_choice(torch_nccl: Path) -> None:
    got = _report(env={"NCCL_RESHARD_DEBUG": "INFO"})
    line = [l for l in got["stderr"].splitlines() if "NCCL_RESHARD INFO using NCCL" in l]
    assert line and "the NCCL mapped in this process" in line[0] and torch_nccl.name in line[0], got["stderr"]


def test_a_vllm_communicator_of_another_nccl_is_refused(torch_nccl: Path, tmp_path: Path) -> None:
    copy = tmp_path / "vllm" / "libnccl.so.2"
    copy.parent.mkdir()
    shutil.copy2(torch_nccl, copy)
    # vLLM's PyNcclCommunicator keeps its NCCL as .nccl.lib (a ctypes CDLL) and the
    # ncclComm_t as .comm; one whose NCCL is not the library's is refused before any NCCL call.
    result = _python(f"""
        import ctypes, os, types
        import ncclreshard as nr
        nr.nccl_library()  # torch's
        theirs = ctypes.CDLL({str(copy)!r}, mode=os.RTLD_LOCAL)
        fake = types.SimpleNamespace(comm=ctypes.c_void_p(0x1234), nccl=types.SimpleNamespace(lib=theirs))
        try:
            nr.comm_from_pynccl(fake)
        except RuntimeError as e:
            print("REFUSED", e)
        try:
            nr.comm_from_pynccl(object())
        except TypeError as e:
            print("TYPE", e)
    """)
    assert result.returncode == 0, result.stderr
    assert f"REFUSED vLLM's NCCL ({copy}) is not the one libncclreshard uses" in result.stdout
    assert "VLLM_NCCL_SO_PATH" in result.stdout
    assert "TYPE expected a vLLM PyNcclCommunicator, got object" in result.stdout


def test_init_comm_refuses_a_rank_outside_the_world() -> None:
    import ncclreshard as nr

    with pytest.raises(ValueError, match=r"rank 4 is not in 0\.\.3"):
        nr.init_comm(4, 4, store=None)
