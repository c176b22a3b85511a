#!/usr/bin/env bash
# A local Confluent-compatible schema registry for development and tests: Apicurio Registry (a
# Quarkus application, Apache-2.0) with in-memory H2 storage, serving Confluent's Schema Registry
# REST API under /apis/ccompat/v7. No Kafka is needed; every start begins empty.
#
#   registry.sh fetch                  download and unpack the server into the cache (once)
#   registry.sh start [--port P] [--dir D] [--foreground] [--timeout S] [--owner-pid PID]
#                     [-- EXTRA_JVM_ARGS...]
#   registry.sh status [--dir D]       exit 0 running, 3 stopped
#   registry.sh stop   [--dir D] [--timeout S]
#   registry.sh java                   print the Java it would use
#
# start waits until the Confluent API answers, then prints the base URL for Confluent clients on
# its last line of stdout (http://127.0.0.1:P/apis/ccompat/v7) and writes it to D/url.
# --port 0 (default 8081) takes any free port. The server listens on 127.0.0.1 only.
# Without --foreground the server outlives the script (pid in D/registry.pid, log in
# D/registry.log); with --foreground the script waits on it and stops it on SIGINT/SIGTERM.
# --owner-pid PID: stop the server when process PID exits (e.g. a test runner).
# D defaults to $TOKENMILL_CACHE/registry/run; one server per directory.
#
# Environment:
#   TOKENMILL_CACHE              cache root (default ~/.cache/tokenmill); the server is unpacked
#                                under registry/apicurio-registry-<version>
#   TOKENMILL_REGISTRY_VERSION   Apicurio version (default 3.3.3, needs Java 21+; 2.6.13.Final runs
#                                on Java 17 but cannot check compatibility of JSON Schema 2019-09/2020-12)
#   TOKENMILL_REGISTRY_JAVA      the java binary to use (default: the first Java new enough among
#                                $JAVA_HOME, PATH and the JDKs installed beside the default java)
#   TOKENMILL_REGISTRY_JVM_OPTS  replaces the default JVM options (heap, GC)
#   TOKENMILL_REGISTRY_APITOMY   1 (default) = 3.x's newer JSON Schema compatibility checker, which
#                                understands drafts 4/6/7/2019-09/2020-12; 0 = the legacy checker
#                                (drafts 4/6/7 only: a 2020-12 check answers HTTP 500)
#   MAVEN_CENTRAL_URL            when Maven is not installed: the Maven Central base URL that curl
#                                downloads the archive from (default: Maven Central itself)
set -euo pipefail

die() { echo "registry.sh: $*" >&2; exit 1; }

VERSION="${TOKENMILL_REGISTRY_VERSION:-3.3.3}"
CACHE_ROOT="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
HOME_DIR="$CACHE_ROOT/registry/apicurio-registry-$VERSION"
GROUP=io.apicurio
ARTIFACT=apicurio-registry-app
CCOMPAT_PATH=/apis/ccompat/v7

# SHA-256 of io.apicurio:apicurio-registry-app:<version>:tar.gz:all, checked after download.
known_sha256() {
    case "$1" in
        3.3.3) echo 8bc6751c76d963734224b01d5e7f84ccb3cb61c87d3bd77c36c35f10a5cbed63 ;;
        2.6.13.Final) echo 3cda1b34aa020fb4ac4dd6a66018d757e81e437f97e20a1f92d366b70091c6ba ;;
        *) echo "" ;;
    esac
}

major_of_version() { echo "${1%%.*}"; }

# ---------------------------------------------------------------------------------------------
# Java: Apicurio 3.x is compiled for Java 21, 2.x for Java 11.

java_major() {  # java_major BIN -> e.g. 17, 25 (empty if it does not run)
    "$1" -XshowSettings:properties -version 2>&1 \
        | sed -n 's/^ *java\.specification\.version = \(1\.\)\{0,1\}\([0-9]*\).*/\2/p' | head -n1
}

find_java() {
    local need=21 cand major
    [[ "$(major_of_version "$VERSION")" -ge 3 ]] || need=17
    local -a cands=()
    [[ -n "${TOKENMILL_REGISTRY_JAVA:-}" ]] && cands+=("$TOKENMILL_REGISTRY_JAVA")
    [[ -n "${JAVA_HOME:-}" ]] && cands+=("$JAVA_HOME/bin/java")
    command -v java >/dev/null && cands+=("$(command -v java)")
    local j
    # The other JDKs installed beside the default one (the directory that holds its JDK).
    local jvms=""
    command -v java >/dev/null && jvms="$(dirname "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")")"
    [[ -n "$jvms" ]] && for j in $(ls -d "$jvms"/*/bin/java 2>/dev/null | sort -rV); do cands+=("$j"); done
    for cand in ${cands[@]+"${cands[@]}"}; do
        [[ -x "$cand" ]] || continue
        major="$(java_major "$cand")"
        if [[ -n "$major" && "$major" -ge "$need" ]]; then
            echo "$cand"
            return 0
        fi
        [[ -n "${TOKENMILL_REGISTRY_JAVA:-}" && "$cand" == "$TOKENMILL_REGISTRY_JAVA" ]] \
            && die "TOKENMILL_REGISTRY_JAVA=$cand is Java ${major:-?}; Apicurio Registry $VERSION needs Java $need+"
    done
    die "no Java $need+ found (looked at \$JAVA_HOME, PATH and the JDKs beside the default java); set TOKENMILL_REGISTRY_JAVA, or TOKENMILL_REGISTRY_VERSION=2.6.13.Final to run on Java 17"
}

# ---------------------------------------------------------------------------------------------
# fetch: io.apicurio:apicurio-registry-app:<version>:tar.gz:all is the server in Quarkus's
# fast-jar layout (3.x: quarkus-run.jar, lib/, app/, quarkus/) or legacy-jar layout (2.x:
# *-runner.jar and lib/). It is unpacked into a temporary directory and renamed into place with a
# marker file, so an interrupted or concurrent fetch never leaves a half-filled directory.

cmd_fetch() {
    [[ -f "$HOME_DIR/.complete" ]] && return 0
    command -v tar >/dev/null || die "tar is needed"
    mkdir -p "$(dirname "$HOME_DIR")"
    local tmp archive="$ARTIFACT-$VERSION-all.tar.gz"
    tmp="$(mktemp -d "$(dirname "$HOME_DIR")/fetch.tmp.XXXXXX")"
    echo "registry.sh: fetching $GROUP:$ARTIFACT:$VERSION:tar.gz:all into $HOME_DIR" >&2
    if command -v mvn >/dev/null; then
        mvn -q -B -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy \
            "-Dartifact=$GROUP:$ARTIFACT:$VERSION:tar.gz:all" "-DoutputDirectory=$tmp" >&2 \
            || { rm -rf "$tmp"; die "Maven could not fetch $GROUP:$ARTIFACT:$VERSION:tar.gz:all"; }
    elif command -v curl >/dev/null; then
        local central="${MAVEN_CENTRAL_URL:-https://repo.maven.apache.org/maven2}"
        curl -fsSL --retry 3 -o "$tmp/$archive" \
            "${central%/}/${GROUP//.//}/$ARTIFACT/$VERSION/$archive" \
            || { rm -rf "$tmp"; die "download of $archive failed"; }
    else
        rm -rf "$tmp"
        die "fetching needs Maven (mvn) or curl"
    fi
    local sum
    sum="$(known_sha256 "$VERSION")"
    if [[ -n "$sum" ]]; then
        echo "$sum  $tmp/$archive" | sha256sum -c --quiet - >&2 \
            || { rm -rf "$tmp"; die "checksum mismatch for $archive"; }
    fi
    mkdir "$tmp/app"
    tar -xzf "$tmp/$archive" -C "$tmp/app" || { rm -rf "$tmp"; die "could not unpack $archive"; }
    [[ -f "$tmp/app/quarkus-run.jar" ]] || compgen -G "$tmp/app/*-runner.jar" >/dev/null \
        || { rm -rf "$tmp"; die "$archive holds no quarkus-run.jar or *-runner.jar"; }
    date -u +%FT%TZ >"$tmp/app/.complete"
    [[ -d "$HOME_DIR" && ! -f "$HOME_DIR/.complete" ]] && rm -rf "$HOME_DIR"
    if ! mv -T "$tmp/app" "$HOME_DIR" 2>/dev/null; then
        [[ -f "$HOME_DIR/.complete" ]] || { rm -rf "$tmp"; die "could not move the server into $HOME_DIR"; }
    fi
    rm -rf "$tmp"
}

server_jar() {
    if [[ -f "$HOME_DIR/quarkus-run.jar" ]]; then
        echo "$HOME_DIR/quarkus-run.jar"
    else
        ls "$HOME_DIR"/*-runner.jar 2>/dev/null | head -n1
    fi
}

# ---------------------------------------------------------------------------------------------
# A running server's directory: registry.pid, registry.log, url.

proc_alive() {
    local state
    state="$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null || true)"
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

running_pid() {  # the server's pid for directory $1, if it is alive and really ours
    local dir="$1" pid
    [[ -f "$dir/registry.pid" ]] || return 1
    pid="$(cat "$dir/registry.pid" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] && proc_alive "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "-Dtokenmill.registry.dir=$dir " || return 1
    echo "$pid"
}

answers() {  # answers URL: the Confluent API lists subjects
    if command -v curl >/dev/null; then
        curl -sf -o /dev/null --max-time 2 "$1/subjects"
    else
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/subjects", timeout=2)' "$1" 2>/dev/null
    fi
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

resolve_dir() {  # resolve_dir D -> absolute path (created)
    local dir="${1:-$CACHE_ROOT/registry/run}"
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

# ---------------------------------------------------------------------------------------------

cmd_start() {
    local port=8081 dir="" timeout=120 owner="" foreground=0
    local -a extra=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --dir) dir="$2"; shift 2 ;;
            --timeout) timeout="$2"; shift 2 ;;
            --owner-pid) owner="$2"; shift 2 ;;
            --foreground) foreground=1; shift ;;
            --) shift; extra=("$@"); break ;;
            *) die "start: unknown argument '$1'" ;;
        esac
    done
    [[ "$port" =~ ^[0-9]+$ ]] || die "start: --port takes a number (got '$port')"
    dir="$(resolve_dir "$dir")"

    local pid
    if pid="$(running_pid "$dir")"; then
        [[ -s "$dir/url" ]] || die "start: a server (pid $pid) already runs on $dir but has not answered yet"
        echo "registry already running: pid $pid, dir $dir" >&2
        cat "$dir/url"
        return 0
    fi
    [[ "$port" != 0 ]] && port_open "$port" && die "start: port $port on 127.0.0.1 is already in use"

    cmd_fetch
    local java jar
    java="$(find_java)"
    jar="$(server_jar)"
    [[ -n "$jar" ]] || die "start: no server jar in $HOME_DIR (remove it and fetch again)"

    # Serial GC and the C1 compiler start fastest on two shared cores.
    local jvm="${TOKENMILL_REGISTRY_JVM_OPTS:--XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xmx384m -XX:+ExitOnOutOfMemoryError}"
    local -a props=(
        "-Dtokenmill.registry.dir=$dir"
        -Dquarkus.http.host=127.0.0.1 "-Dquarkus.http.port=$port"
        -Dquarkus.http.access-log.enabled=false
    )
    if [[ "$(major_of_version "$VERSION")" -ge 3 ]]; then
        # 3.x has a separate management interface (health, metrics); any free loopback port.
        props+=(-Dquarkus.management.host=127.0.0.1 -Dquarkus.management.port=0)
        if [[ "${TOKENMILL_REGISTRY_APITOMY:-1}" != 0 ]]; then
            props+=(-Dapicurio.features.experimental.enabled=true -Dapicurio.compat.json-schema.use-apitomy=true)
        fi
    fi

    local log="$dir/registry.log"
    rm -f "$dir/registry.pid" "$dir/url"
    echo "=== start $(date -u +%FT%TZ) version=$VERSION port=$port java=$java" >"$log"
    # setsid: the server is not hit by the caller's terminal signals. The inner shell writes its
    # own pid, moves to D, then exec turns it into the JVM (same pid), so no process is left
    # holding the caller's stdout.
    # shellcheck disable=SC2086,SC2016
    setsid bash -c 'echo $$ >"$0"; cd "$1" || exit 1; shift; exec "$@"' "$dir/registry.pid" "$dir" \
        "$java" $jvm "${props[@]}" ${extra[@]+"${extra[@]}"} -jar "$jar" </dev/null >>"$log" 2>&1 &

    local deadline=$((SECONDS + timeout))
    while [[ ! -s "$dir/registry.pid" ]]; do
        ((SECONDS < deadline)) || die "start: the JVM did not start (log: $log)"
        sleep 0.1
    done
    pid="$(cat "$dir/registry.pid")"

    local url="" actual
    while true; do
        if ! proc_alive "$pid"; then
            tail -n 40 "$log" >&2
            rm -f "$dir/registry.pid"
            die "start: the server exited during start-up (log: $log)"
        fi
        if [[ -z "$url" ]]; then
            actual="$port"
            if [[ "$port" == 0 ]]; then
                actual="$(sed -n 's|.*Listening on: http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$log" | head -n1)"
            fi
            [[ -n "$actual" ]] && url="http://127.0.0.1:$actual$CCOMPAT_PATH"
        fi
        if [[ -n "$url" ]] && answers "$url"; then
            break
        fi
        if ((SECONDS >= deadline)); then
            tail -n 40 "$log" >&2
            kill -TERM "$pid" 2>/dev/null || true
            die "start: the registry did not answer within ${timeout}s (log: $log)"
        fi
        sleep 0.2
    done
    echo "$url" >"$dir/url"

    if [[ -n "$owner" ]]; then
        setsid nohup bash "${BASH_SOURCE[0]}" _watch --dir "$dir" --owner-pid "$owner" --pid "$pid" \
            </dev/null >>"$log" 2>&1 &
    fi
    echo "registry running: pid $pid, Apicurio Registry $VERSION, log $log" >&2
    echo "$url"

    if [[ "$foreground" == 1 ]]; then
        trap 'cmd_stop --dir "$dir" >&2; exit 0' INT TERM
        while proc_alive "$pid"; do sleep 1; done
        rm -f "$dir/registry.pid" "$dir/url"
    fi
}

cmd__watch() {
    local dir="" owner="" pid=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --dir) dir="$2"; shift 2 ;;
            --owner-pid) owner="$2"; shift 2 ;;
            --pid) pid="$2"; shift 2 ;;
            *) die "_watch: unknown argument '$1'" ;;
        esac
    done
    while proc_alive "$owner" && proc_alive "$pid"; do sleep 1; done
    if proc_alive "$pid" && [[ "$(running_pid "$dir" || true)" == "$pid" ]]; then
        echo "registry.sh: owner process $owner is gone; stopping the registry (pid $pid)" >&2
        cmd_stop --dir "$dir"
    fi
}

cmd_status() {
    local dir=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --dir) dir="$2"; shift 2 ;;
            *) die "status: unknown argument '$1'" ;;
        esac
    done
    dir="$(resolve_dir "$dir")"
    local pid
    if pid="$(running_pid "$dir")" && [[ -s "$dir/url" ]] && answers "$(cat "$dir/url")"; then
        echo "registry running: pid $pid, $(cat "$dir/url")"
        return 0
    fi
    echo "registry stopped: dir $dir"
    return 3
}

cmd_stop() {
    local dir="" timeout=30
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --dir) dir="$2"; shift 2 ;;
            --timeout) timeout="$2"; shift 2 ;;
            *) die "stop: unknown argument '$1'" ;;
        esac
    done
    dir="$(resolve_dir "$dir")"
    local pid
    if pid="$(running_pid "$dir")"; then
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + timeout))
        while proc_alive "$pid"; do
            if ((SECONDS >= deadline)); then
                kill -KILL "$pid" 2>/dev/null || true
                sleep 0.5
                break
            fi
            sleep 0.2
        done
    fi
    rm -f "$dir/registry.pid" "$dir/url"
    echo "registry stopped: dir $dir"
}

main() {
    local cmd="${1:-}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        fetch) cmd_fetch ;;
        start) cmd_start "$@" ;;
        status) cmd_status "$@" ;;
        stop) cmd_stop "$@" ;;
        java) find_java ;;
        _watch) cmd__watch "$@" ;;
        -h|--help|help|"")
            awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
            [[ -n "$cmd" ]] ;;
        *) die "unknown command '$cmd' (fetch, start, status, stop, java)" ;;
    esac
}

main "$@"
