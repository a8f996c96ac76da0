"""deploy/k8s/: the manifests' structure (a LeaderWorkerSet whose pods find their ranks and the leader in
LWS's environment, a Service over them, a ServiceMonitor on that Service, a PrometheusRule equal to
deploy/prometheus/alerts.yml), the pod template against Kubernetes' own schema, and the container's
command run through bash for every pod of a group, with an `ep-serve` stand-in that parses the flags
with ep-serve's parser and builds its engine config (ranks, rendezvous, hosts and the Buffer transport)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from deploy_helpers import ALERTS, DEPLOY, ROOT

K8S = DEPLOY / "k8s"
LEADER = "ep-serve-dsv3-0.ep-serve-dsv3.default"  # what LWS puts in LWS_LEADER_ADDRESS


def docs() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        (doc,) = list(yaml.safe_load_all(path.read_text()))
        assert doc["kind"] not in out, f"two {doc['kind']}s"
        out[doc["kind"]] = doc
    return out


def templates(lws: dict) -> list[dict]:
    spec = lws["spec"]["leaderWorkerTemplate"]
    return [spec["workerTemplate"], *([spec["leaderTemplate"]] if "leaderTemplate" in spec else [])]


def container(template: dict) -> dict:
    (c,) = [c for c in template["spec"]["containers"] if c["name"] == "ep-serve"]
    return c


def test_the_manifests_and_kustomization():
    kinds = docs()
    assert set(kinds) == {"LeaderWorkerSet", "Service", "ServiceMonitor", "PrometheusRule"}
    assert kinds["LeaderWorkerSet"]["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert kinds["ServiceMonitor"]["apiVersion"] == kinds["PrometheusRule"]["apiVersion"] == "monitoring.coreos.com/v1"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


def test_leaderworkerset_pods():
    lws = docs()["LeaderWorkerSet"]
    spec = lws["spec"]["leaderWorkerTemplate"]
    assert spec["size"] >= 2 and spec["restartPolicy"] == "RecreateGroupOnPodRestart"
    for template in templates(lws):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
        c = container(template)
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(env["GPUS_PER_POD"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == 8000
        probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert probes["startupProbe"]["path"] == probes["livenessProbe"]["path"] == "/health"
        assert probes["readinessProbe"]["path"] == "/v1/models"
        assert all(p["port"] == "http" for p in probes.values())
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/models"]]["persistentVolumeClaim"]["readOnly"]
        # RDMA between the hosts: GPU-initiated, with memory pinned past the memlock limit and the NICs.
        assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert any(name.startswith("rdma/") for name in c["resources"]["limits"])


def test_pod_templates_follow_the_kubernetes_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for template in templates(docs()["LeaderWorkerSet"]):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ep-serve"},
                        "template": template}
        kubernetes_validate.validate(pod_template, kubernetes_validate.latest_version(), strict=True)
    kubernetes_validate.validate(docs()["Service"], kubernetes_validate.latest_version(), strict=True)


def test_service_and_servicemonitor_reach_the_pods():
    kinds = docs()
    service, monitor = kinds["Service"], kinds["ServiceMonitor"]
    # The alerts select job="ep-serve": the ServiceMonitor's job label is the Service's name.
    assert service["metadata"]["name"] == "ep-serve" and "jobLabel" not in monitor["spec"]
    assert 'job="ep-serve"' in ALERTS.read_text()
    for template in templates(kinds["LeaderWorkerSet"]):
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


def test_prometheusrule_is_alerts_yml():
    rule = docs()["PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


_K8S_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' own expansion of command and args: $(VAR) of the container's env, $$ -> $; an
    unknown reference (such as bash's $((...))) stays as it is."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _K8S_REF.sub(one, text)


STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, sys
    sys.path.insert(0, {root!r})
    from serving.cli import build_parser, engine_config
    args = build_parser().parse_args(sys.argv[1:])
    config = engine_config(args, args.model, (args.served_model_name or [args.model])[0])
    print(json.dumps(dict(model=args.model, host=args.host, port=args.port, size=config.data_parallel_size,
                          ep=config.expert_parallel, ranks=list(config.local_ranks),
                          address=config.data_parallel_address, rpc_port=config.dist_port,
                          transport=config.ep_transport, nnodes=config.nnodes, spans_hosts=config.spans_hosts)))
    """)


def test_every_pod_of_a_group_runs_its_ranks_of_one_job(tmp_path):
    """The container's command under bash, with LWS's variables for each pod of the group: ep-serve's
    parser accepts every flag, and the pods split the ranks of one job that meets at the leader."""
    lws = docs()["LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    stub = tmp_path / "ep-serve"
    stub.write_text(STAND_IN.format(python=sys.executable, root=str(ROOT)))
    stub.chmod(0o755)
    for template in templates(lws):
        c = container(template)
        env = {e["name"]: e["value"] for e in c["env"]}
        gpus = int(env["GPUS_PER_POD"])
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        seen: list[int] = []
        for index in range(size):
            pod_env = {**env, "LWS_LEADER_ADDRESS": LEADER, "LWS_GROUP_SIZE": str(size),
                       "LWS_WORKER_INDEX": str(index)}
            argv = [k8s_expand(a, pod_env) for a in [*c["command"], *c["args"]]]
            assert argv[:2] == ["/bin/bash", "-c"]
            run_env = {**os.environ, **pod_env, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
            out = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, f"pod {index}: {out.stderr}"
            got = json.loads(out.stdout)
            assert got["size"] == size * gpus and got["ep"], got
            assert got["ranks"] == list(range(index * gpus, (index + 1) * gpus)), got
            assert got["address"] == LEADER and got["rpc_port"] == 29550, got
            assert got["host"] == "0.0.0.0" and got["port"] == 8000, got
            assert got["transport"] == "auto" and got["nnodes"] == size and got["spans_hosts"], got
            assert any(got["model"].startswith(m + "/") for m in mounts), got["model"]
            seen += got["ranks"]
        assert sorted(seen) == list(range(size * gpus))
