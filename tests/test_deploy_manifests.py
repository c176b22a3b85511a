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


def _stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's build stages by name (`FROM image AS name`), each from its FROM on, in order."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for i, a in _dockerfile():
        if i == "FROM":
            words = a.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"every stage is named: FROM {a}"
            current = stages.setdefault(words[2], [])
        current.append((i, a))
    return stages


def test_dockerfile_cuda_runtime_non_root_cache_volume():
    stages = _stages()
    # The default target (the last stage) is tokenmill's own engine on a CUDA runtime image.
    default = list(stages)[-1]
    assert default == "worker"
    instr = stages[default]
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


# -- every manifest against its kind's schema ------------------------------------------------------------
def _all_docs():
    return [(path.relative_to(K8S).as_posix(), doc) for path in sorted(K8S.rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def test_every_manifest_holds_to_its_kinds_schema():
    """The schema check kubectl --dry-run=client would make with a cluster's API (tests/k8s_schemas.py)."""
    from tests.k8s_schemas import problems

    docs = _all_docs()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "LeaderWorkerSet", "ScaledObject", "ConfigMap"}
    found = {f"{name} {d['kind']} {d['metadata']['name']}": p for name, d in docs if (p := problems(d))}
    assert not found, found


def test_the_schema_check_catches_a_misspelt_field_and_a_wrong_type():
    from tests.k8s_schemas import problems

    (lws,) = [d for _, d in _all_docs() if d["kind"] == "LeaderWorkerSet"]
    lws["spec"]["leaderWorkerTemplate"]["sizes"] = lws["spec"]["leaderWorkerTemplate"].pop("size")
    so = next(d for _, d in _all_docs() if d["kind"] == "ScaledObject")
    so["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 512
    assert any("'sizes' was unexpected" in p for p in problems(lws))
    assert any("lagThreshold: 512 is not of type 'string'" in p for p in problems(so))


# -- the vLLM backend's GPU workers ----------------------------------------------------------------------
VLLM = K8S / "vllm"


def _vllm(name: str, kind: str) -> dict:
    (found,) = [d for d in yaml.safe_load_all((VLLM / name).read_text()) if d and d["kind"] == kind]
    return found


def _engine_config(config_map: dict):
    """The worker's EngineConfig from a ConfigMap's TOKENMILL_* variables, as `tokenmill worker` reads
    them (its flags' defaults), validated as the worker validates it."""
    import os
    from unittest import mock

    from tokenmill.cli import build_parser
    from tokenmill.cli.engine_options import engine_config_from_args

    env = {k: v for k, v in config_map["data"].items() if k.startswith("TOKENMILL_")}
    with mock.patch.dict(os.environ, env):
        args = build_parser().parse_args(["worker"])
    return engine_config_from_args(args, args.model)


def _vllm_args(config) -> dict:
    from tokenmill.engine.backends.vllm.settings import parse_vllm_args

    values, problems = parse_vllm_args(config.vllm_args)
    assert not problems
    return values


def _gpus(pod_spec: dict) -> int:
    (container,) = pod_spec["containers"]
    res = container["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == int(res["requests"]["nvidia.com/gpu"])
    return int(res["requests"]["nvidia.com/gpu"])


def _shared_memory(pod_spec: dict) -> bool:
    """/dev/shm backed by memory (vLLM's tensor-parallel workers talk through it)."""
    (container,) = pod_spec["containers"]
    shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    return any(v["name"] in shm and v.get("emptyDir", {}).get("medium") == "Memory" for v in pod_spec["volumes"])


def _lag_trigger_of(so: dict, config_map: dict, target_kind: str, target_name: str) -> None:
    data = config_map["data"]
    ref = so["spec"]["scaleTargetRef"]
    assert (ref.get("kind", "Deployment"), ref["name"]) == (target_kind, target_name)
    (trigger,) = so["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka" and trigger["authenticationRef"]["name"] == "tokenmill-kafka-sasl"
    assert (meta["consumerGroup"], meta["topic"], meta["bootstrapServers"]) == (
        data["TOKENMILL_GROUP_ID"], data["TOKENMILL_JOBS_TOPIC"], data["TOKENMILL_BOOTSTRAP_SERVERS"])
    assert int(meta["lagThreshold"]) == 2 * int(data["TOKENMILL_MAX_NUM_SEQS"])
    partitions = int(so["metadata"]["annotations"]["tokenmill.io/jobs-topic-partitions"])
    assert partitions >= so["spec"]["maxReplicaCount"] >= so["spec"]["minReplicaCount"] >= 1


def test_the_vllm_image_is_a_build_target_on_vllms_image_running_tokenmill_non_root():
    instr = _stages()["vllm-worker"]
    (base,) = [a for i, a in instr if i == "FROM"]
    assert base.startswith("vllm/vllm-openai:v") and not base.split()[0].endswith(":latest")
    env = {t.split("=", 1)[0]: t.split("=", 1)[1] for i, a in instr if i == "ENV" for t in shlex.split(a)}
    assert env["TOKENMILL_BACKEND"] == "vllm" and env["TOKENMILL_CACHE"]
    assert any(env["TOKENMILL_CACHE"] in a for i, a in instr if i == "VOLUME")
    users = [a for i, a in instr if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    run = " ".join(a for i, a in instr if i == "RUN")
    assert "--constraint" in run and "vllm" in run  # vLLM's own torch and vLLM stay as its image has them
    assert [a for i, a in instr if i == "ENTRYPOINT"][-1] == '["tokenmill"]'


def test_one_pod_splits_the_model_over_its_gpus_by_tensor_parallelism():
    cm, dep = _vllm("tensor-parallel.yaml", "ConfigMap"), _vllm("tensor-parallel.yaml", "Deployment")
    config = _engine_config(cm)
    assert config.backend == "vllm"
    pod = dep["spec"]["template"]["spec"]
    assert _vllm_args(config)["tensor_parallel_size"] == _gpus(pod) > 1
    assert _shared_memory(pod)
    (container,) = pod["containers"]
    assert {"configMapRef": {"name": cm["metadata"]["name"]}} in container["envFrom"]
    assert "vllm" in container["image"] and container["args"] == ["worker"]
    assert pod["terminationGracePeriodSeconds"] > int(cm["data"]["TOKENMILL_DRAIN_TIMEOUT"])
    so = _vllm("tensor-parallel.yaml", "ScaledObject")
    _lag_trigger_of(so, cm, "Deployment", dep["metadata"]["name"])
    assert so["spec"]["cooldownPeriod"] >= pod["terminationGracePeriodSeconds"]
    topic = _vllm("tensor-parallel.yaml", "KafkaTopic")
    assert topic["metadata"]["name"] == cm["data"]["TOKENMILL_JOBS_TOPIC"]
    assert topic["spec"]["partitions"] == int(so["metadata"]["annotations"]["tokenmill.io/jobs-topic-partitions"])
    pdb = _vllm("tensor-parallel.yaml", "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_a_model_larger_than_a_node_runs_on_a_leader_worker_set_whose_leader_owns_the_consumer():
    cm, lws = _vllm("leaderworkerset.yaml", "ConfigMap"), _vllm("leaderworkerset.yaml", "LeaderWorkerSet")
    config = _engine_config(cm)
    args = _vllm_args(config)
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    size = template["size"]
    # Pipeline stages across the group's pods, tensor parallel within one: every GPU of the group used.
    assert size > 1 and args["pipeline_parallel_size"] == size
    assert args["tensor_parallel_size"] * args["pipeline_parallel_size"] == _gpus(leader) + (size - 1) * _gpus(worker)
    assert args["distributed_executor_backend"] == "ray"
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost pod restarts its group
    # The leader is the only Kafka consumer: it alone has the worker's settings, runs tokenmill, is probed.
    (lead,) = leader["containers"]
    (follow,) = worker["containers"]
    assert {"configMapRef": {"name": cm["metadata"]["name"]}} in lead["envFrom"]
    assert "exec tokenmill worker" in lead["args"][0] and "ray start --head" in lead["args"][0]
    assert "$LWS_GROUP_SIZE" in lead["args"][0]  # it waits for its whole group before it consumes
    assert lead["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "envFrom" not in follow and not any(e["name"].startswith("TOKENMILL_") for e in follow.get("env", ()))
    assert "tokenmill" not in " ".join(follow["args"]) and "$(LWS_LEADER_ADDRESS):6379" in follow["args"][0]
    # Every pod of a group reads the checkpoint from the same path.
    model = cm["data"]["TOKENMILL_MODEL"]
    for spec in (leader, worker):
        (container,) = spec["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        root = next(path for path in mounts if model.startswith(path + "/"))
        claim = next(v for v in spec["volumes"] if v["name"] == mounts[root])["persistentVolumeClaim"]["claimName"]
        assert claim == _vllm("leaderworkerset.yaml", "PersistentVolumeClaim")["metadata"]["name"]
        assert _shared_memory(spec)
    assert leader["terminationGracePeriodSeconds"] > int(cm["data"]["TOKENMILL_DRAIN_TIMEOUT"])
    so = _vllm("leaderworkerset.yaml", "ScaledObject")
    _lag_trigger_of(so, cm, "LeaderWorkerSet", lws["metadata"]["name"])
    assert so["spec"]["scaleTargetRef"]["apiVersion"] == lws["apiVersion"]
    assert so["spec"]["cooldownPeriod"] >= leader["terminationGracePeriodSeconds"]
    topic = _vllm("leaderworkerset.yaml", "KafkaTopic")
    assert topic["spec"]["partitions"] == int(so["metadata"]["annotations"]["tokenmill.io/jobs-topic-partitions"])


def test_the_dlq_has_a_partition_for_every_partition_of_the_vllm_jobs_topics():
    dlq = next(d for _, d in _docs() if d["kind"] == "KafkaTopic" and d["metadata"]["name"] == "tokenmill.dlq")
    for name in ("tensor-parallel.yaml", "leaderworkerset.yaml"):
        assert _vllm(name, "KafkaTopic")["spec"]["partitions"] <= dlq["spec"]["partitions"]
