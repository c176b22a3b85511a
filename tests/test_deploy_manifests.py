"""Parse every deployment manifest and check the invariants operators rely on."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"


def _docs():
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def _one(kind):
    found = [d for _, d in _docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_every_manifest_parses_and_is_a_kubernetes_object():
    docs = _docs()
    assert len(docs) >= 6
    for name, doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), name
        assert doc["metadata"].get("name"), name


def test_deployment_requests_a_gpu_and_runs_non_root():
    dep = _one("Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    res = container["resources"]
    assert int(res["requests"]["nvidia.com/gpu"]) >= 1
    assert int(res["limits"]["nvidia.com/gpu"]) == int(res["requests"]["nvidia.com/gpu"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_probes_hit_readyz_and_healthz_on_the_metrics_port():
    container = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    cm = _one("ConfigMap")["data"]
    assert int(cm["TOKENMILL_METRICS_PORT"]) == ports[container["readinessProbe"]["httpGet"]["port"]]


def test_grace_period_exceeds_drain_timeout():
    dep = _one("Deployment")
    drain = int(_one("ConfigMap")["data"]["TOKENMILL_DRAIN_TIMEOUT"])
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain, (grace, drain)
    # And scale-down waits at least that long before it takes away another worker.
    for so in (d for _, d in _docs() if d["kind"] == "ScaledObject"):
        assert so["spec"]["cooldownPeriod"] >= grace, so["metadata"]["name"]


def test_configmap_and_secret_references():
    dep = _one("Deployment")
    cm = _one("ConfigMap")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"configMapRef": {"name": cm["metadata"]["name"]}} in container["envFrom"]
    secret_refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    # Kafka SASL credentials and S3 credentials come from Secrets, never from the ConfigMap.
    assert {"TOKENMILL_SASL_USERNAME", "TOKENMILL_SASL_PASSWORD"} <= secret_refs.keys()
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secret_refs.keys()
    for key in cm["data"]:
        assert not re.search(r"PASSWORD|SECRET|ACCESS_KEY", key), f"secret-like key {key} in ConfigMap"
    assert not [d for _, d in _docs() if d["kind"] == "Secret"], "no Secret values in the repository"
    # The KEDA trigger authenticates with the same Secret.
    auth = _one("TriggerAuthentication")
    assert {r["name"] for r in auth["spec"]["secretTargetRef"]} == {"tokenmill-kafka-sasl"}


def test_pdb_selects_the_worker_pods():
    pdb = _one("PodDisruptionBudget")
    dep = _one("Deployment")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable") is not None


def _scaled_object(name: str) -> dict:
    (found,) = [d for _, d in _docs() if d["kind"] == "ScaledObject" and d["metadata"]["name"] == name]
    return found


def test_keda_scaledobject_on_consumer_lag():
    so = _scaled_object("tokenmill-worker-smollm2")
    dep = _one("Deployment")
    cm = _one("ConfigMap")["data"]
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    (trigger,) = so["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    assert meta["consumerGroup"] == cm["TOKENMILL_GROUP_ID"]
    assert meta["topic"] == cm["TOKENMILL_JOBS_TOPIC"]
    assert meta["bootstrapServers"] == cm["TOKENMILL_BOOTSTRAP_SERVERS"]
    # lagThreshold derived from one worker's in-flight capacity (running + one batch waiting).
    assert int(meta["lagThreshold"]) == 2 * int(cm["TOKENMILL_MAX_NUM_SEQS"])
    # The rule partitions >= max replicas, written next to it and true for the topic definition.
    partitions = int(so["metadata"]["annotations"]["tokenmill.io/jobs-topic-partitions"])
    assert partitions >= so["spec"]["maxReplicaCount"] >= so["spec"]["minReplicaCount"] >= 1
    text = (K8S / "keda-scaledobject.yaml").read_text()
    assert "partitions of the jobs topic >= maxReplicaCount" in text
    topics = {d["metadata"]["name"]: d for _, d in _docs() if d["kind"] == "KafkaTopic"}
    assert topics[meta["topic"]]["spec"]["partitions"] == partitions


def test_keda_scaledobject_on_the_oldest_unfinished_jobs_age():
    lag, age = _scaled_object("tokenmill-worker-smollm2"), _scaled_object("tokenmill-worker-smollm2-age")
    cm = _one("ConfigMap")["data"]
    # An alternative to the lag one for the same workload (KEDA allows one ScaledObject per workload).
    assert age["spec"]["scaleTargetRef"] == lag["spec"]["scaleTargetRef"]
    assert age["metadata"]["annotations"]["tokenmill.io/alternative-to"] == lag["metadata"]["name"]
    (trigger,) = age["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "prometheus" and meta["metricType"] == "AverageValue"
    assert "tokenmill_oldest_unfinished_job_age_seconds" in meta["query"]
    assert f'topic="{cm["TOKENMILL_JOBS_TOPIC"]}"' in meta["query"]
    assert float(meta["threshold"]) > float(meta["activationThreshold"]) > 0
    partitions = int(age["metadata"]["annotations"]["tokenmill.io/jobs-topic-partitions"])
    assert partitions >= age["spec"]["maxReplicaCount"] >= age["spec"]["minReplicaCount"] >= 1
    assert age["spec"]["cooldownPeriod"] == lag["spec"]["cooldownPeriod"]
    # The metric the query names is the worker's own.
    from tokenmill.metrics import WorkerMetrics

    names = {m.name for m in WorkerMetrics().registry.collect()}
    assert "tokenmill_oldest_unfinished_job_age_seconds" in names


def test_topics_dlq_partitions_cover_jobs():
    topics = {d["metadata"]["name"]: d["spec"] for _, d in _docs() if d["kind"] == "KafkaTopic"}
    jobs = [s["partitions"] for n, s in topics.items() if n.startswith("tokenmill.jobs")]
    assert jobs and topics["tokenmill.dlq"]["partitions"] >= max(jobs)
    for name, spec in topics.items():
        assert int(spec["config"]["retention.ms"]) > 0, name
    notes = (DEPLOY / "TOPICS.md").read_text()
    for word in ("partitions", "retention", "dlq"):
        assert word in notes


def _dockerfile():
    lines, buf = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        buf += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(buf.strip())
            buf = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_dockerfile_cuda_runtime_non_root_cache_volume():
    instr = _dockerfile()
    froms = [a for i, a in instr if i == "FROM"]
    assert len(froms) == 1 and "cuda" in froms[0] and "runtime" in froms[0]
    users = [a for i, a in instr if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    cache = None
    for i, a in instr:
        if i == "ENV":
            for token in shlex.split(a):
                if token.startswith("TOKENMILL_CACHE="):
                    cache = token.split("=", 1)[1]
    assert cache, "TOKENMILL_CACHE must point at the model cache"
    volumes = [a for i, a in instr if i == "VOLUME"]
    assert any(cache in v for v in volumes)
    # The Deployment mounts a volume exactly there.
    container = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert cache in [m["mountPath"] for m in container["volumeMounts"]]
    entry = [a for i, a in instr if i == "ENTRYPOINT"]
    assert entry and "tokenmill" in entry[-1]


@pytest.mark.parametrize("name", ["configmap.yaml", "deployment.yaml", "pdb.yaml", "keda-scaledobject.yaml", "topics.yaml"])
def test_expected_manifest_files_exist(name):
    assert (K8S / name).is_file()


def test_every_tokenmill_setting_is_a_worker_flag():
    """A typo in a TOKENMILL_* name would be silently ignored by the worker: check each one."""
    from tokenmill.cli import build_parser, env_var_for

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    worker = sub.choices["worker"]
    known = {env_var_for(s) for a in worker._actions for s in a.option_strings if s.startswith("--")}
    container = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    names = set(_one("ConfigMap")["data"]) | {e["name"] for e in container["env"]}
    used = {n for n in names if n.startswith("TOKENMILL_")}
    assert used and used <= known, sorted(used - known)
