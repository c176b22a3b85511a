"""Worker parts that need no broker: backpressure, bad-input guard, tenant cap, security options,
flags and environment variables, metrics and health endpoints, answer records."""

import json
import urllib.error
import urllib.request

import pytest

from tokenmill.cli import build_parser
from tokenmill.cli.commands.worker import settings_from_args
from tokenmill.engine.types import FinishReason, RequestDelta, Timing, Usage
from tokenmill.kafka import answers
from tokenmill.kafka.backpressure import BackpressureGate, BackpressurePolicy
from tokenmill.kafka.guard import BadInputGuard, BadInputGuardTripped
from tokenmill.kafka.security import KafkaSecurity, Secret, read_secret
from tokenmill.kafka.tenants import TenantLimiter
from tokenmill.kafka.transactions import transactional_id
from tokenmill.metrics import HealthState, MetricsServer, WorkerMetrics
from tokenmill.schemas.constants import DEAD_LETTER_HEADERS


# -- backpressure -------------------------------------------------------------------------------
def test_backpressure_pauses_above_high_and_resumes_only_below_low():
    gate = BackpressureGate(BackpressurePolicy(waiting_high=100, waiting_low=50, kv_high=0.9, kv_low=0.7))
    assert not gate.update(waiting=99, kv_usage=0.5)
    assert gate.update(waiting=100, kv_usage=0.5)  # high-water reached
    assert gate.update(waiting=60, kv_usage=0.5)  # between the marks: stays paused (no flapping)
    assert not gate.update(waiting=50, kv_usage=0.5)
    assert gate.update(waiting=0, kv_usage=0.95)  # KV cache full pauses too
    assert gate.update(waiting=0, kv_usage=0.75)
    assert not gate.update(waiting=0, kv_usage=0.7)


def test_backpressure_policy_rejects_inverted_marks():
    with pytest.raises(ValueError):
        BackpressurePolicy(waiting_high=10, waiting_low=10)
    with pytest.raises(ValueError):
        BackpressurePolicy(kv_high=0.5, kv_low=0.6)


# -- bad-input guard ----------------------------------------------------------------------------
def test_guard_trips_only_when_the_window_is_mostly_bad():
    g = BadInputGuard(max_ratio=0.8, window=10)
    for _ in range(10):
        g.record(None)
    for _ in range(7):
        g.record("invalid_job")  # 7 of the last 10 bad: below 80%, keep going
    assert g.bad_ratio == pytest.approx(0.7)
    with pytest.raises(BadInputGuardTripped, match="8 of the last 10 inputs were invalid.*model_mismatch: 1"):
        g.record("model_mismatch")


def test_guard_needs_a_full_window_before_judging():
    g = BadInputGuard(max_ratio=0.5, window=100)
    for _ in range(99):
        g.record("invalid_job")  # a poison burst at start-up is not yet "most inputs"
    with pytest.raises(BadInputGuardTripped):
        g.record("invalid_job")


# -- tenants ------------------------------------------------------------------------------------
def test_tenant_cap_holds_and_releases_in_order():
    lim = TenantLimiter(max_inflight_per_tenant=2)
    assert lim.admit("a", 1) and lim.admit("a", 2)
    assert not lim.admit("a", 3) and not lim.admit("a", 4)
    assert lim.admit("b", 5)  # other tenants are not held up
    assert lim.admit(None, 6) and lim.admit(None, 7) and lim.admit(None, 8)  # no tenant: no cap
    assert lim.held == 2
    assert lim.release("a") == 3  # frees a slot, which the oldest held job takes
    assert lim.running("a") == 2
    assert lim.release("a") == 4
    assert lim.release("a") is None and lim.running("a") == 1
    assert lim.drop_held(lambda item: True) == []


def test_tenant_cap_zero_means_off():
    lim = TenantLimiter(0)
    assert all(lim.admit("a", i) for i in range(100))


# -- security -----------------------------------------------------------------------------------
def test_sasl_scram_kwargs_and_no_secret_in_descriptions():
    sec = KafkaSecurity(protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512", sasl_username="svc",
                        sasl_password=Secret("hunter2"))
    kw = sec.aiokafka_kwargs()
    assert kw == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                  "sasl_plain_username": "svc", "sasl_plain_password": "hunter2"}
    for text in (repr(sec), str(sec), json.dumps(sec.describe())):
        assert "hunter2" not in text


def test_security_validation_names_every_problem(tmp_path):
    with pytest.raises(ValueError, match="needs --sasl-mechanism.*needs --sasl-username"):
        KafkaSecurity(protocol="SASL_SSL").validate()
    with pytest.raises(ValueError, match="not SASL_PLAINTEXT or SASL_SSL"):
        KafkaSecurity(protocol="PLAINTEXT", sasl_username="x").validate()
    with pytest.raises(ValueError, match="no such file"):
        KafkaSecurity(protocol="SSL", ssl_cafile=str(tmp_path / "missing.pem")).validate()
    with pytest.raises(ValueError, match="go together"):
        KafkaSecurity(protocol="SSL", ssl_certfile=str(tmp_path / "c.pem")).validate()


def test_ssl_builds_a_context():
    kw = KafkaSecurity(protocol="SSL", ssl_check_hostname=False).aiokafka_kwargs()
    assert kw["security_protocol"] == "SSL" and kw["ssl_context"].check_hostname is False


def test_secret_from_file(tmp_path):
    f = tmp_path / "pw"
    f.write_text("s3cret\n")
    assert read_secret(None, str(f), "pw").reveal() == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        read_secret("x", str(f), "pw")


# -- flags and environment ----------------------------------------------------------------------
def _parse(argv, monkeypatch=None, env=None):
    if env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return build_parser().parse_args(["worker", *argv])


def test_worker_flags_map_to_settings():
    args = _parse(["--bootstrap-servers", "h:1", "--model", "/m", "--exactly-once", "--group-id", "g",
                   "--max-inflight-per-partition", "7", "--max-inflight-per-tenant", "3", "--drain-timeout", "4",
                   "--bad-input-ratio", "0.5", "--bad-input-window", "20", "--max-num-seqs", "8",
                   "--instance-id", "pod-1"])
    s = settings_from_args(args)
    assert s.exactly_once and s.group_id == "g" and s.max_inflight_per_partition == 7
    assert s.max_inflight_per_tenant == 3 and s.drain_timeout_s == 4 and s.bad_input_window == 20
    assert s.engine.max_num_seqs == 8 and s.backpressure.waiting_high == 16
    assert s.instance_id == "pod-1" and s.worker_name == "pod-1"


def test_every_worker_flag_reads_its_environment_variable(monkeypatch):
    args = _parse([], monkeypatch, {
        "TOKENMILL_BOOTSTRAP_SERVERS": "env:9092", "TOKENMILL_MODEL": "/env-model",
        "TOKENMILL_EXACTLY_ONCE": "true", "TOKENMILL_JOBS_TOPIC": "jobs.env",
        "TOKENMILL_MAX_INFLIGHT_PER_PARTITION": "9", "TOKENMILL_SASL_PASSWORD": "pw",
        "TOKENMILL_SECURITY_PROTOCOL": "SASL_SSL", "TOKENMILL_SASL_MECHANISM": "PLAIN",
        "TOKENMILL_SASL_USERNAME": "u",
    })
    s = settings_from_args(args)
    assert (s.bootstrap_servers, s.engine.model, s.exactly_once, s.jobs_topic) == ("env:9092", "/env-model", True,
                                                                                    "jobs.env")
    assert s.max_inflight_per_partition == 9
    assert s.security.aiokafka_kwargs()["sasl_plain_password"] == "pw"


def test_bad_settings_are_refused_with_a_reason():
    args = _parse(["--bootstrap-servers", "h:1", "--model", "/m", "--results-topic", "tokenmill.jobs"])
    with pytest.raises(ValueError, match="must all differ"):
        settings_from_args(args)
    args = _parse(["--bootstrap-servers", "h:1", "--model", "/m", "--bad-input-ratio", "1.5"])
    with pytest.raises(ValueError, match="bad-input-ratio"):
        settings_from_args(args)
    with pytest.raises(SystemExit):
        _parse(["--bootstrap-servers", "h:1", "--model", "/m", "--max-inflight-per-partition", "0"])


def test_transactional_ids_are_per_group_topic_partition():
    a = transactional_id("g", "jobs", 0)
    assert a != transactional_id("g", "jobs", 1) != transactional_id("h", "jobs", 0)
    assert len(transactional_id("g" * 300, "jobs", 3)) < 100


# -- metrics and health ---------------------------------------------------------------------------
def _get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_health_and_readiness_endpoints():
    m, h = WorkerMetrics(), HealthState()
    server = MetricsServer(m, h, "127.0.0.1", 0).start()
    try:
        m.jobs_ok.inc(3)
        m.jobs_dead_lettered.labels("invalid_job").inc()
        m.commit_lag.labels("jobs", "0").set(5)
        m.ttft.observe(12.0)
        m.observe_tokens(50)
        status, body = _get(server.port, "/metrics")
        assert status == 200
        assert "tokenmill_jobs_ok_total 3.0" in body
        assert 'tokenmill_jobs_dead_lettered_total{code="invalid_job"} 1.0' in body
        assert 'tokenmill_commit_lag{partition="0",topic="jobs"} 5.0' in body
        assert "tokenmill_ttft_ms_bucket" in body and "tokenmill_output_tokens_per_second" in body
        assert _get(server.port, "/healthz")[0] == 200
        assert _get(server.port, "/readyz") == (503, "model not loaded\n")
        h.model_loaded = True
        assert _get(server.port, "/readyz") == (503, "consumer group not joined\n")
        h.group_joined = True
        assert _get(server.port, "/readyz")[0] == 200
        h.stall_after_s = -1  # the loop "stopped ticking"
        assert _get(server.port, "/healthz")[0] == 503
        assert _get(server.port, "/nope")[0] == 404
    finally:
        server.stop()


# -- answer records ------------------------------------------------------------------------------
def test_dead_letter_keeps_bytes_and_carries_contract_headers():
    rec = answers.dead_letter(b"k\xff", b"\x00not json", "invalid_job", "not JSON: x" * 1000, dlq_topic="dlq",
                              source_topic="jobs", partition=2, offset=17, dlq_partition=None)
    assert rec.key == b"k\xff" and rec.value == b"\x00not json"
    headers = dict(rec.headers)
    assert set(headers) == set(DEAD_LETTER_HEADERS)
    assert headers["tokenmill.error.code"] == b"invalid_job"
    assert headers["tokenmill.source.partition"] == b"2" and headers["tokenmill.source.offset"] == b"17"
    assert len(headers["tokenmill.error.message"]) <= answers.MAX_ERROR_MESSAGE


def test_token_events_and_result_from_deltas():
    from tokenmill.schemas.decode import decode_job

    job = decode_job(b'{"job_id": "j1", "prompt": "hi", "stream": true, "metadata": {"a": 1}}')
    ev = json.loads(answers.token_event("j1", "w-1", 0, RequestDelta("r", [5, 6], "ab")))
    assert ev == {"job_id": "j1", "attempt": "w-1", "index": 0, "token_ids": [5, 6], "text": "ab", "finished": False}
    final = RequestDelta("r", [7], "c", finished=True, finish_reason=FinishReason.STOP, usage=Usage(3, 3, 0),
                         timing=Timing(1, 2, 3, 4), output_token_ids=[5, 6, 7], output_text="abc")
    res = answers.build_result(job, final, model="m", worker="w", attempt="w-1",
                               source=answers.source_of("jobs", 0, 4))
    wire = json.loads(answers.result_record(res, "results").value)
    assert wire["status"] == "ok" and wire["text"] == "abc" and wire["source"]["offset"] == 4
    assert wire["metadata"] == {"a": 1}


def test_worker_settings_embed_the_engine_config_itself():
    # The worker hands its EngineConfig to the engine unchanged (the model path resolved): there is
    # no second list of engine fields that could miss one.
    import typing

    from tokenmill.config import WorkerSettings
    from tokenmill.engine import EngineConfig

    assert typing.get_type_hints(WorkerSettings)["engine"] is EngineConfig
