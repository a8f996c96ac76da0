"""Builds ep_layer._C (the CUDA kernels in csrc/, bound with pybind11) when nvcc is there.

Without nvcc, or with EP_LAYER_NO_CUDA=1, it installs the pure-Python package: `import ep_layer` works
and the `reference` backend runs. EP_LAYER_CUDA_ARCHS picks the GPU targets (default "90a;80").
The module links against the CUDA runtime only, never libtorch, so it works with any torch build.

Where NVSHMEM is found (EP_LAYER_NVSHMEM_HOME, else the nvidia-nvshmem-cu13 package), it also builds
ep_layer._C_nvshmem: the same kernels with their NVSHMEM put paths, relocatable device code linked with
NVSHMEM's device library and its host library (the one nvshmem4py loads, so both share one job).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"
SKIP_HINT = "Set EP_LAYER_NO_CUDA=1 to install without the CUDA kernels (the reference backend still works)."


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gencode_flags() -> list[str]:
    archs = os.environ.get("EP_LAYER_CUDA_ARCHS", "90a;80").replace(",", ";").split(";")
    flags = []
    for arch in filter(None, (a.strip() for a in archs)):
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def find_nvshmem() -> Path | None:
    """NVSHMEM's install (include/, lib/): EP_LAYER_NVSHMEM_HOME, else the nvidia-nvshmem-cu13 package, on
    sys.path or in the site-packages of the environment being installed into (pip builds in an isolated
    environment of its own)."""
    home = os.environ.get("EP_LAYER_NVSHMEM_HOME")
    if home:
        return Path(home)
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:
        spec = None
    locations = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    paths = sysconfig.get_paths()
    locations += [Path(paths[key]) / "nvidia" / "nvshmem" for key in ("purelib", "platlib")]
    found = [p for p in locations if (p / "lib" / "libnvshmem_device.a").exists()]
    return found[0] if found else None


# Sources only the NVSHMEM build compiles.
NVSHMEM_ONLY = {"nvshmem_glue.cu"}


class NvccExtension(Extension):
    def __init__(self, name: str, nvshmem: Path | None = None) -> None:
        super().__init__(name, sources=[])
        self.nvshmem = nvshmem


class BuildNvcc(build_ext):
    """Compiles every csrc/*.cu and csrc/*.cpp in one nvcc call into the extension's shared object (for
    the NVSHMEM build, as relocatable device code linked with NVSHMEM's libraries)."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NvccExtension):
            return super().build_extension(ext)
        import pybind11

        nvcc = find_nvcc()
        assert nvcc is not None
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        sources = sorted(str(p) for p in [*CSRC.glob("*.cu"), *CSRC.glob("*.cpp")]
                         if ext.nvshmem is not None or p.name not in NVSHMEM_ONLY)
        cccl = Path(nvcc).resolve().parent.parent / "include" / "cccl"
        nvshmem_compile, nvshmem_link = [], []
        if ext.nvshmem is not None:
            lib = ext.nvshmem / "lib"
            nvshmem_compile = ["-rdc=true", "-DEP_LAYER_NVSHMEM", "-DEP_LAYER_MODULE=_C_nvshmem",
                               f"-I{ext.nvshmem / 'include'}"]
            # The installed layout has site-packages/ep_layer beside site-packages/nvidia/nvshmem.
            nvshmem_link = [str(lib / "libnvshmem_device.a"), f"-L{lib}", "-l:libnvshmem_host.so.3",
                            "-Xlinker", "-rpath,$ORIGIN/../nvidia/nvshmem/lib"]
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",
               "--expt-relaxed-constexpr", "-lineinfo", *gencode_flags(),
               f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}",
               *([f"-I{cccl}"] if cccl.exists() else []), *nvshmem_compile, *sources, *nvshmem_link, "-o", str(out)]
        print(" ".join(cmd), flush=True)
        try:
            subprocess.run(cmd, check=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"building the CUDA kernels failed (nvcc exit {e.returncode}). {SKIP_HINT}") from e


def extensions() -> list[Extension]:
    if os.environ.get("EP_LAYER_NO_CUDA") == "1":
        return []
    if not any(CSRC.glob("*.cu")):
        return []
    if find_nvcc() is None:
        print(f"ep-layer: nvcc not found, installing without the CUDA kernels. {SKIP_HINT}", file=sys.stderr)
        return []
    nvshmem = find_nvshmem()
    return [NvccExtension("ep_layer._C"), *([NvccExtension("ep_layer._C_nvshmem", nvshmem)] if nvshmem else [])]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNvcc})
