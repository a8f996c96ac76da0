#!/usr/bin/env python3
"""Fetch the Python sources of the serving engines whose real code drives the `deep_ep` drop-in in the tests
(tests/test_dropin_vllm.py, tests/test_dropin_sglang.py), into a cache outside the repository.

    python scripts/fetch_engines.py                    # every engine release the tests use; prints each path
    python scripts/fetch_engines.py vllm==0.20.0       # just these

Each release's wheel comes from PyPI (`pip download --no-deps --no-cache-dir`, into a temporary folder that is
removed, so no wheel stays on disk);
its `.py` files are kept, and the few non-Python trees its import path checks for (KEPT_TREES), in
${EP_LAYER_ENGINE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ep-layer}/<name>-<version>/, beside the compiled packages its
sources import and the test extra lacks (IMPORTED_PACKAGES: whole, without their dependencies).
A release already there is not fetched again, so a second run returns at once (one cached before a tree was kept
is fetched again). Nothing of the engines enters this repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# vLLM 0.20.0: the first release of the torch 2.11 line (the GPU machine's torch). vLLM 0.29.0: the request schemas
# the server's fields are checked against. vLLM 0.34.0: the newest release on PyPI. SGLang 0.5.17: its python package.
RELEASES = ("vllm==0.20.0", "vllm==0.29.0", "vllm==0.34.0", "sglang==0.5.17")
# Compiled packages a release's import path needs that the test extra does not install, fetched beside its sources
# (only its tests see them): vLLM 0.34.0 imports vllm.v1.structured_output for every request type
# (vllm/v1/request.py), and with it xgrammar, llguidance and xgrammar's tvm_ffi (versions of 2026-12-07; none pulls
# triton at import).
IMPORTED_PACKAGES = {"vllm==0.34.0": ("xgrammar==0.2.9", "llguidance==1.9.1", "apache-tvm-ffi==0.1.15.post2")}
# Non-Python files kept, per engine: SGLang's JIT kernel package looks for its C++ sources when it is imported
# (sglang 0.5.17 sglang/kernels/jit/utils/compile.py:95 raises "Cannot find sglang.kernels.jit path" without
# include/ and csrc/ beside it), and its DeepEP dispatcher's imports pass through it (about 3 MB).
KEPT_TREES = {"sglang": ("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/")}
_COMPLETE = ".complete"  # written last: a folder without it is an interrupted fetch


def cache_root() -> Path:
    """Where the sources go: $EP_LAYER_ENGINE_CACHE, else $XDG_CACHE_HOME/ep-layer, else ~/.cache/ep-layer."""
    explicit = os.environ.get("EP_LAYER_ENGINE_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ep-layer"


def source_dir(name: str, version: str) -> Path:
    """The folder that holds (or will hold) one release's sources; it goes on sys.path."""
    return cache_root() / f"{name}-{version}"


def cached(name: str, version: str) -> bool:
    """Whether the cache holds the release whole: fetched to the end, with the trees KEPT_TREES names for it and the
    packages IMPORTED_PACKAGES names (its marker lists each wheel it was made from)."""
    dest = source_dir(name, version)
    marker = dest / _COMPLETE
    wheels = 1 + len(IMPORTED_PACKAGES.get(f"{name}=={version}", ()))
    return (marker.exists() and len(marker.read_text().split()) == wheels
            and all((dest / tree).is_dir() for tree in KEPT_TREES.get(name, ())))


def extract_sources(wheel: Path, dest: Path, trees: tuple[str, ...] = ()) -> None:
    """The wheel's packages' `.py` files into `dest`, and every file under `trees`: no compiled extensions, other
    data, metadata or scripts."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            top = member.split("/", 1)[0]
            if top.endswith((".dist-info", ".data")) or member.endswith("/"):
                continue
            if member.endswith(".py") or member.startswith(trees):
                archive.extract(member, dest)


def extract_package(wheel: Path, dest: Path) -> None:
    """A compiled package's wheel into `dest` whole: its shared objects, and its metadata (llguidance reads its own
    version through importlib.metadata)."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(dest)


def download(requirement: str, folder: Path) -> Path:
    """`requirement`'s wheel for this Python and platform, without its dependencies, into `folder`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                    "--disable-pip-version-check", "--no-input", "-q", "-d", str(folder), requirement], check=True)
    wheels = list(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"fetch_engines: pip download {requirement} gave {[w.name for w in wheels]}")
    return wheels[0]


def fetch(requirement: str) -> Path:
    """Fetch `name==version` unless it is cached; return its folder."""
    name, _, version = requirement.partition("==")
    if not name or not version:
        raise SystemExit(f"fetch_engines: want NAME==VERSION, got {requirement!r}")
    dest = source_dir(name, version)
    if cached(name, version):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-{version}-") as tmp:
        wheel = download(requirement, Path(tmp))
        staged = Path(tmp) / "src"
        extract_sources(wheel, staged, KEPT_TREES.get(name, ()))
        packages = [download(package, Path(tmp) / package) for package in IMPORTED_PACKAGES.get(requirement, ())]
        for package in packages:
            extract_package(package, staged)
        (staged / _COMPLETE).write_text("".join(f"{w.name}\n" for w in (wheel, *packages)))
        if cached(name, version):  # another process fetched it meanwhile
            return dest
        if dest.exists():  # an interrupted earlier fetch, or one from before KEPT_TREES or IMPORTED_PACKAGES
            shutil.rmtree(dest)
        staged.rename(dest)
    return dest


def main(argv: list[str]) -> int:
    for requirement in argv or RELEASES:
        print(fetch(requirement))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
