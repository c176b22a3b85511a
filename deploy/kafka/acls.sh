#!/usr/bin/env bash
# The Kafka ACLs tokenmill's clients need, created with Kafka's own kafka-acls.sh, on a cluster
# whose authorizer refuses what no ACL allows (allow.everyone.if.no.acl.found=false).
#
#   deploy/kafka/acls.sh [--dry-run] --bootstrap-server HOST:PORT [--command-config ADMIN.properties]
#
# --dry-run prints the kafka-acls.sh commands instead of running them. --command-config is the
# admin client's properties file (SASL_SSL settings of a principal allowed to change ACLs).
# KAFKA_ACLS names the kafka-acls.sh to run (default: kafka-acls.sh on PATH).
#
# Principals and names come from the environment; the defaults are those of deploy/k8s and
# deploy/TOPICS.md. An empty principal skips its role.
#   WORKER_PRINCIPAL    (User:tokenmill-worker)    tokenmill worker (and KEDA's lag scaler, same Secret)
#   PRODUCER_PRINCIPAL  (User:tokenmill-producer)  tokenmill produce
#   READER_PRINCIPAL    (User:tokenmill-reader)    tokenmill tail
#   BACKFILL_PRINCIPAL  (User:tokenmill-backfill)  tokenmill backfill --engine kafka
#   GROUP_ID            (tokenmill-smollm2-135m-instruct)       the workers' consumer group
#   JOBS_TOPIC          (tokenmill.jobs.smollm2-135m-instruct)  the workers' jobs topic
#   PRODUCE_JOBS_TOPIC  (tokenmill.jobs.{model})   the producers' --jobs-topic; {model} = a prefix ACL
#   RESULTS_TOPIC (tokenmill.results)  TOKENS_TOPIC (tokenmill.tokens)  DLQ_TOPIC (tokenmill.dlq)
#   EXACTLY_ONCE        (false)  true: the workers run --exactly-once and need their transactional ids
#
# Run it once per worker group (one per served model, each with its GROUP_ID and JOBS_TOPIC).
# The same list is in worker/kafka/acls.py (a test holds the two equal) and in docs/operations.md.
set -euo pipefail

die() { echo "acls.sh: $*" >&2; exit 1; }

dry_run=false
conn=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) dry_run=true; shift ;;
        --bootstrap-server) conn+=(--bootstrap-server "$2"); shift 2 ;;
        --command-config) conn+=(--command-config "$2"); shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) die "unknown argument '$1'" ;;
    esac
done
[[ "$dry_run" == true || ${#conn[@]} -gt 0 ]] || die "--bootstrap-server is required (or --dry-run)"

WORKER_PRINCIPAL="${WORKER_PRINCIPAL-User:tokenmill-worker}"
PRODUCER_PRINCIPAL="${PRODUCER_PRINCIPAL-User:tokenmill-producer}"
READER_PRINCIPAL="${READER_PRINCIPAL-User:tokenmill-reader}"
BACKFILL_PRINCIPAL="${BACKFILL_PRINCIPAL-User:tokenmill-backfill}"
GROUP_ID="${GROUP_ID:-tokenmill-smollm2-135m-instruct}"
JOBS_TOPIC="${JOBS_TOPIC:-tokenmill.jobs.smollm2-135m-instruct}"
PRODUCE_JOBS_TOPIC="${PRODUCE_JOBS_TOPIC:-tokenmill.jobs.{model\}}"
RESULTS_TOPIC="${RESULTS_TOPIC:-tokenmill.results}"
TOKENS_TOPIC="${TOKENS_TOPIC:-tokenmill.tokens}"
DLQ_TOPIC="${DLQ_TOPIC:-tokenmill.dlq}"
EXACTLY_ONCE="${EXACTLY_ONCE:-false}"
[[ "$EXACTLY_ONCE" == true || "$EXACTLY_ONCE" == false ]] || die "EXACTLY_ONCE is true or false (got '$EXACTLY_ONCE')"

acl() {  # acl PRINCIPAL OPERATION RESOURCE-OPTION [NAME] [prefixed]
    local cmd=("${KAFKA_ACLS:-kafka-acls.sh}" ${conn[@]+"${conn[@]}"} --add --allow-principal "$1" --operation "$2" "$3")
    [[ -n "${4:-}" ]] && cmd+=("$4")
    [[ "${5:-}" == prefixed ]] && cmd+=(--resource-pattern-type prefixed)
    if [[ "$dry_run" == true ]]; then
        printf '%q ' "${cmd[@]}"
        echo
    else
        "${cmd[@]}"
    fi
}

writes() {  # writes PRINCIPAL RESOURCE-OPTION NAME [prefixed]: Write and Describe
    acl "$1" Write "$2" "$3" "${4:-}"
    acl "$1" Describe "$2" "$3" "${4:-}"
}

# The jobs topic of a producer: a literal topic, or the prefix before {model}.
jobs_acls() {  # jobs_acls PRINCIPAL
    if [[ "$PRODUCE_JOBS_TOPIC" == *"{model}"* ]]; then
        local prefix="${PRODUCE_JOBS_TOPIC%%\{model\}*}"
        [[ -n "$prefix" ]] || die "PRODUCE_JOBS_TOPIC '$PRODUCE_JOBS_TOPIC' needs a fixed start for its ACL"
        writes "$1" --topic "$prefix" prefixed
    else
        writes "$1" --topic "$PRODUCE_JOBS_TOPIC"
    fi
    acl "$1" IdempotentWrite --cluster
}

if [[ -n "$WORKER_PRINCIPAL" ]]; then
    # Read the jobs, in the group (which also lets KEDA read the group's lag).
    acl "$WORKER_PRINCIPAL" Read --topic "$JOBS_TOPIC"
    acl "$WORKER_PRINCIPAL" Read --group "$GROUP_ID"
    # Write Results, TokenEvents and dead letters; read those topics' max.message.bytes at start.
    for topic in "$RESULTS_TOPIC" "$TOKENS_TOPIC" "$DLQ_TOPIC"; do
        writes "$WORKER_PRINCIPAL" --topic "$topic"
        acl "$WORKER_PRINCIPAL" DescribeConfigs --topic "$topic"
    done
    # The producer is idempotent.
    acl "$WORKER_PRINCIPAL" IdempotentWrite --cluster
    if [[ "$EXACTLY_ONCE" == true ]]; then
        # One transactional id per input partition: tokenmill.<group>.<jobs topic>.<partition>.
        writes "$WORKER_PRINCIPAL" --transactional-id "tokenmill.$GROUP_ID." prefixed
    fi
fi
if [[ -n "$PRODUCER_PRINCIPAL" ]]; then
    jobs_acls "$PRODUCER_PRINCIPAL"
fi
if [[ -n "$READER_PRINCIPAL" ]]; then
    # tail assigns partitions itself: no group.
    acl "$READER_PRINCIPAL" Read --topic "$RESULTS_TOPIC"
    acl "$READER_PRINCIPAL" Read --topic "$TOKENS_TOPIC"
fi
if [[ -n "$BACKFILL_PRINCIPAL" ]]; then
    jobs_acls "$BACKFILL_PRINCIPAL"
    acl "$BACKFILL_PRINCIPAL" Read --topic "$RESULTS_TOPIC"
fi
