"""JSON Schemas of the Kubernetes objects deploy/k8s/ holds, for a schema check without a cluster
(kubectl --dry-run=client needs one's API; none is here).

Each schema is the part of the object's API that our manifests use, written after the API's own
definitions (core/v1, apps/v1, policy/v1, KEDA's keda.sh/v1alpha1, LeaderWorkerSet's
leaderworkerset.x-k8s.io/v1, Strimzi's kafka.strimzi.io/v1beta2): the field names, their types, the
enumerations, what is required. Objects are closed (additionalProperties false), so a misspelt or
misplaced field fails as the API server would refuse it; a field the API has and these schemas do not
list yet fails too, and is then added here from the API's definition.
"""

from __future__ import annotations

from typing import Any

STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STR_MAP = {"type": "object", "additionalProperties": STR}
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[mkMGTPE])?$"}]}
INT_OR_STR = {"anyOf": [INT, STR]}


def obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def array(items: dict[str, Any], min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items}


METADATA = obj({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP}, ("name",))
TEMPLATE_METADATA = obj({"labels": STR_MAP, "annotations": STR_MAP})
SELECTOR = obj({"matchLabels": STR_MAP}, ("matchLabels",))

ENV_VAR = obj({
    "name": STR,
    "value": STR,
    "valueFrom": obj({
        "fieldRef": obj({"fieldPath": STR, "apiVersion": STR}, ("fieldPath",)),
        "secretKeyRef": obj({"name": STR, "key": STR, "optional": BOOL}, ("key",)),
        "configMapKeyRef": obj({"name": STR, "key": STR, "optional": BOOL}, ("key",)),
    }),
}, ("name",))
ENV_FROM = obj({"prefix": STR, "configMapRef": obj({"name": STR, "optional": BOOL}),
                "secretRef": obj({"name": STR, "optional": BOOL})})
PORT = obj({"name": STR, "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
            "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}, ("containerPort",))
PROBE = obj({
    "httpGet": obj({"path": STR, "port": INT_OR_STR, "scheme": {"enum": ["HTTP", "HTTPS"]}}, ("port",)),
    "exec": obj({"command": array(STR, 1)}),
    "tcpSocket": obj({"port": INT_OR_STR}, ("port",)),
    "initialDelaySeconds": INT, "periodSeconds": INT, "timeoutSeconds": INT, "successThreshold": INT,
    "failureThreshold": INT,
})
RESOURCES = obj({"requests": {"type": "object", "additionalProperties": QUANTITY},
                 "limits": {"type": "object", "additionalProperties": QUANTITY}})
MOUNT = obj({"name": STR, "mountPath": STR, "readOnly": BOOL, "subPath": STR}, ("name", "mountPath"))
CONTAINER = obj({
    "name": STR, "image": STR, "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "command": array(STR), "args": array(STR), "workingDir": STR, "env": array(ENV_VAR), "envFrom": array(ENV_FROM),
    "ports": array(PORT), "resources": RESOURCES, "readinessProbe": PROBE, "livenessProbe": PROBE,
    "startupProbe": PROBE, "volumeMounts": array(MOUNT),
    "securityContext": obj({"runAsNonRoot": BOOL, "runAsUser": INT, "allowPrivilegeEscalation": BOOL,
                            "readOnlyRootFilesystem": BOOL}),
}, ("name", "image"))
ACCESS_MODES = array({"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}, 1)
PVC_SPEC = obj({"accessModes": ACCESS_MODES, "storageClassName": STR,
                "resources": obj({"requests": obj({"storage": QUANTITY}, ("storage",))}, ("requests",))},
               ("accessModes", "resources"))
VOLUME = {
    **obj({
        "name": STR,
        "emptyDir": obj({"medium": {"enum": ["", "Memory"]}, "sizeLimit": QUANTITY}),
        "ephemeral": obj({"volumeClaimTemplate": obj({"metadata": TEMPLATE_METADATA, "spec": PVC_SPEC}, ("spec",))},
                         ("volumeClaimTemplate",)),
        "persistentVolumeClaim": obj({"claimName": STR, "readOnly": BOOL}, ("claimName",)),
        "configMap": obj({"name": STR}, ("name",)),
        "secret": obj({"secretName": STR}, ("secretName",)),
    }, ("name",)),
    "minProperties": 2,  # a name and one source
    "maxProperties": 2,
}
TOLERATION = obj({"key": STR, "operator": {"enum": ["Exists", "Equal"]}, "value": STR,
                  "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}, "tolerationSeconds": INT})
POD_SPEC = obj({
    "containers": array(CONTAINER, 1), "initContainers": array(CONTAINER), "volumes": array(VOLUME),
    "tolerations": array(TOLERATION), "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
    "securityContext": obj({"runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT, "fsGroup": INT}),
    "nodeSelector": STR_MAP, "serviceAccountName": STR, "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
}, ("containers",))
POD_TEMPLATE = obj({"metadata": TEMPLATE_METADATA, "spec": POD_SPEC}, ("spec",))


def kind(api_version: str, name: str, properties: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    return obj({"apiVersion": {"const": api_version}, "kind": {"const": name}, "metadata": METADATA, **properties},
               ("apiVersion", "kind", "metadata", *required))


SCHEMAS: dict[str, dict[str, Any]] = {
    "ConfigMap": kind("v1", "ConfigMap", {"data": STR_MAP}, ("data",)),
    "PersistentVolumeClaim": kind("v1", "PersistentVolumeClaim", {"spec": PVC_SPEC}, ("spec",)),
    "Deployment": kind("apps/v1", "Deployment", {"spec": obj({
        "replicas": {"type": "integer", "minimum": 0}, "selector": SELECTOR, "template": POD_TEMPLATE,
        "strategy": obj({"type": {"enum": ["RollingUpdate", "Recreate"]},
                         "rollingUpdate": obj({"maxUnavailable": INT_OR_STR, "maxSurge": INT_OR_STR})}),
    }, ("selector", "template"))}, ("spec",)),
    "PodDisruptionBudget": kind("policy/v1", "PodDisruptionBudget", {"spec": obj({
        "maxUnavailable": INT_OR_STR, "minAvailable": INT_OR_STR, "selector": SELECTOR}, ("selector",))}, ("spec",)),
    "ScaledObject": kind("keda.sh/v1alpha1", "ScaledObject", {"spec": obj({
        "scaleTargetRef": obj({"name": STR, "apiVersion": STR, "kind": STR, "envSourceContainerName": STR}, ("name",)),
        "minReplicaCount": INT, "maxReplicaCount": INT, "pollingInterval": INT, "cooldownPeriod": INT,
        "idleReplicaCount": INT,
        "triggers": array(obj({
            "type": STR, "name": STR, "metadata": STR_MAP,  # every trigger setting is a string
            "authenticationRef": obj({"name": STR, "kind": {"enum": ["TriggerAuthentication",
                                                                     "ClusterTriggerAuthentication"]}}, ("name",)),
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]}, "useCachedMetrics": BOOL,
        }, ("type", "metadata")), 1),
    }, ("scaleTargetRef", "triggers"))}, ("spec",)),
    "TriggerAuthentication": kind("keda.sh/v1alpha1", "TriggerAuthentication", {"spec": obj({
        "secretTargetRef": array(obj({"parameter": STR, "name": STR, "key": STR}, ("parameter", "name", "key")), 1),
    })}, ("spec",)),
    "LeaderWorkerSet": kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", {"spec": obj({
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "rolloutStrategy": obj({"type": {"enum": ["RollingUpdate"]}, "rollingUpdateConfiguration": obj({
            "maxUnavailable": INT_OR_STR, "maxSurge": INT_OR_STR, "partition": INT})}),
        "networkConfig": obj({"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}),
        "leaderWorkerTemplate": obj({
            "size": {"type": "integer", "minimum": 1},
            "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
            "leaderTemplate": POD_TEMPLATE, "workerTemplate": POD_TEMPLATE,
        }, ("workerTemplate",)),
    }, ("leaderWorkerTemplate",))}, ("spec",)),
    "KafkaTopic": kind("kafka.strimzi.io/v1beta2", "KafkaTopic", {"spec": obj({
        "partitions": {"type": "integer", "minimum": 1}, "replicas": {"type": "integer", "minimum": 1},
        "topicName": STR, "config": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
    }, ("partitions",))}, ("spec",)),
}


def problems(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one manifest document, as 'path: message'."""
    from jsonschema import Draft202012Validator

    schema = SCHEMAS.get(doc.get("kind"))
    if schema is None:
        return [f"no schema for kind {doc.get('kind')!r} (add it to tests/k8s_schemas.py)"]
    found = Draft202012Validator(schema).iter_errors(doc)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in found)
