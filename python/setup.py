"""Builds libncclreshard.so from the repository this directory belongs to and ships it in the
wheel (ncclreshard/lib/), with the package version read from the workspace's Cargo.toml (the
version's only home). The wheel is tagged py3-none-<platform>: it holds a native library but
no Python extension, so one wheel serves every Python 3.

Environment: CARGO (the cargo to run, default `cargo`), CARGO_TARGET_DIR (cargo's own).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIBRARY = "libncclreshard.so"


def workspace_version() -> str:
    manifest = ROOT / "Cargo.toml"
    if not manifest.is_file():
        raise SystemExit(
            f"{manifest} not found: the ncclreshard Python package builds from the "
            "libncclreshard repository (pip install ./python in a clone)"
        )
    section = re.search(r"^\[workspace\.package\](.*?)^\[", manifest.read_text(), re.S | re.M)
    version = section and re.search(r'^version\s*=\s*"([^"]+)"', section.group(1), re.M)
    if not version:
        raise SystemExit(f"{manifest}: no version in [workspace.package]")
    return version.group(1)


class BuildWithLibrary(build_py):
    """build_py that also runs `cargo build --release -p ncclreshard` and copies the library."""

    def run(self) -> None:
        super().run()
        cargo = os.environ.get("CARGO", "cargo")
        subprocess.run(
            [cargo, "build", "--release", "--locked", "-p", "ncclreshard",
             "--manifest-path", str(ROOT / "Cargo.toml")],
            check=True,
        )
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        if not target.is_absolute():
            target = ROOT / target
        built = target / "release" / LIBRARY
        out = Path(self.build_lib) / "ncclreshard" / "lib"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, out / LIBRARY)
        (Path(self.build_lib) / "ncclreshard" / "_version.py").write_text(
            f'"""Written by setup.py from Cargo.toml."""\n\n__version__ = "{workspace_version()}"\n'
        )


class PlatformWheel(bdist_wheel):
    """A platform wheel (it carries a native library) for any Python 3."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    version=workspace_version(),
    cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel},
)
