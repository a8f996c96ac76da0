"""scripts/fetch_engines.py: which files of a wheel it keeps, and that a cached release costs no download."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fetch_engines.py"
_spec = importlib.util.spec_from_file_location("fetch_engines", SCRIPT)
assert _spec is not None and _spec.loader is not None
fetch_engines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_engines)


@pytest.mark.parametrize("trees, extra", [((), []), (("eng/k/",), ["eng/k/inc/kernel.cuh", "eng/k/kernel.cu"])])
def test_keeps_the_packages_python_files_and_the_trees_named(tmp_path: Path, trees: tuple, extra: list) -> None:
    wheel = tmp_path / "eng-1.0-py3-none-any.whl"
    members = {"eng/__init__.py": "", "eng/sub/mod.py": "X = 1\n", "eng/_C.abi3.so": "\0", "eng/k/kernel.cu": "",
               "eng/k/inc/kernel.cuh": "", "eng/kk/other.cu": "", "eng-1.0.dist-info/METADATA": "Name: eng\n",
               "eng-1.0.data/scripts/tool.py": "", "eng/config.json": "{}"}
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    fetch_engines.extract_sources(wheel, tmp_path / "out", trees)
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert kept == sorted(["eng/__init__.py", "eng/sub/mod.py", *extra])
    assert (tmp_path / "out" / "eng" / "sub" / "mod.py").read_text() == "X = 1\n"


def test_sglang_keeps_its_jit_kernel_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached SGLang release without the kernel trees its import checks for (one fetched before they were kept)
    does not count as cached, so that it is fetched again; with them it does."""
    monkeypatch.setenv("EP_LAYER_ENGINE_CACHE", str(tmp_path))
    dest = fetch_engines.source_dir("sglang", "0.0.1")
    dest.mkdir()
    (dest / ".complete").write_text("sglang-0.0.1-py3-none-any.whl\n")
    assert not fetch_engines.cached("sglang", "0.0.1")
    for tree in fetch_engines.KEPT_TREES["sglang"]:
        (dest / tree).mkdir(parents=True)
    assert fetch_engines.cached("sglang", "0.0.1")


def test_an_imported_package_is_kept_whole(tmp_path: Path) -> None:
    """A compiled package a release imports keeps its shared objects and its metadata (importlib.metadata reads
    it), not only its Python files."""
    wheel = tmp_path / "pkg-1.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    members = {"pkg/__init__.py": "", "pkg/_core.so": "\0", "pkg-1.0.dist-info/METADATA": "Name: pkg\nVersion: 1.0\n"}
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    fetch_engines.extract_package(wheel, tmp_path / "out")
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert kept == sorted(members)


def test_a_release_cached_without_its_imported_packages_is_fetched_again(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A release's marker lists the wheels its folder was made from: one made before its imported packages were
    fetched beside it does not count as cached."""
    monkeypatch.setenv("EP_LAYER_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setitem(fetch_engines.IMPORTED_PACKAGES, "eng==0.0.1", ("pkg==1.0", "other==2.0"))
    dest = fetch_engines.source_dir("eng", "0.0.1")
    dest.mkdir()
    (dest / ".complete").write_text("eng-0.0.1-py3-none-any.whl\n")
    assert not fetch_engines.cached("eng", "0.0.1")
    (dest / ".complete").write_text("eng-0.0.1-py3-none-any.whl\npkg-1.0-cp311-abi3.whl\nother-2.0-py3-none-any.whl\n")
    assert fetch_engines.cached("eng", "0.0.1")


def test_a_cached_release_is_not_fetched_again(tmp_path: Path) -> None:
    """With the release's folder complete in the cache, the script prints it and asks pip nothing (pip would
    fail on this made-up name)."""
    cached = tmp_path / "no-such-engine-0.0.1"
    cached.mkdir()
    (cached / ".complete").write_text("no-such-engine-0.0.1-py3-none-any.whl\n")
    env = {**os.environ, "EP_LAYER_ENGINE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPT), "no-such-engine==0.0.1"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(cached)


def test_cache_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$EP_LAYER_ENGINE_CACHE, else $XDG_CACHE_HOME/ep-layer."""
    monkeypatch.delenv("EP_LAYER_ENGINE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fetch_engines.source_dir("vllm", "0.20.0") == tmp_path / "ep-layer" / "vllm-0.20.0"
    monkeypatch.setenv("EP_LAYER_ENGINE_CACHE", str(tmp_path / "elsewhere"))
    assert fetch_engines.cache_root() == tmp_path / "elsewhere"
