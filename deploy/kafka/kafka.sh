#!/usr/bin/env bash
# A local single-node Apache Kafka (KRaft, combined broker + controller) for development and tests.
#
#   kafka.sh fetch                                   copy the Kafka jars into the cache (once)
#   kafka.sh start  --port P --data-dir D [--controller-port C] [--timeout S] [--owner-pid PID]
#                   [--auto-create-topics true|false]
#                   [--sasl-ssl T --scram-users FILE [--super-user NAME]]
#   kafka.sh tls    --dir T [--days N]                 a CA and a broker key store (keytool), for --sasl-ssl
#   kafka.sh status --data-dir D                      exit 0 running, 3 stopped
#   kafka.sh stop   --data-dir D [--timeout S]        SIGTERM, wait, SIGKILL fallback
#   kafka.sh libs                                     print the jar directory (after fetch)
#   kafka.sh lock                                     rewrite jars.lock from pom.xml (needs Maven)
#
# --sasl-ssl: the client listener is SASL_SSL (SCRAM-SHA-512, the TLS files of `kafka.sh tls` in
# T) and ACLs are enforced (StandardAuthorizer, nothing allowed without an ACL); see
# server-sasl-ssl.properties.template. FILE holds one `name=password` line per SCRAM user; they are
# created when the storage is formatted (the first start of a data directory) and NAME (default
# admin) is the super user the broker itself logs in as. Without --sasl-ssl the node is PLAINTEXT
# with no authorizer.
#
# Everything a running node needs lives in its data directory:
#   D/server.properties  D/kafka.pid  D/kafka.log  D/ports  D/log/ (the Kafka log dir)
# Starting again on an existing data directory keeps the data: storage is formatted only once,
# and the controller port is reused because the single-node quorum records its endpoint.
#
# Environment: TOKENMILL_CACHE (default ~/.cache/tokenmill) holds the jars under
# kafka/<version>/libs; TOKENMILL_KAFKA_VERSION overrides the version pinned in pom.xml;
# TOKENMILL_KAFKA_FETCH=maven|curl forces how fetch gets the jars (default: Maven if installed);
# MAVEN_CENTRAL_URL replaces Maven Central for the curl fallback of fetch;
# KAFKA_HEAP_OPTS and KAFKA_JVM_OPTS replace the default JVM settings; JAVA (default: java).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
POM="$HERE/pom.xml"
JAVA="${JAVA:-java}"

die() { echo "kafka.sh: $*" >&2; exit 1; }

pinned_version() {
    sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM" | head -n1
}
KAFKA_VERSION="${TOKENMILL_KAFKA_VERSION:-$(pinned_version)}"
[[ -n "$KAFKA_VERSION" ]] || die "cannot read <kafka.version> from $POM"
CACHE_ROOT="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}"
LIBS="$CACHE_ROOT/kafka/$KAFKA_VERSION/libs"

# ---------------------------------------------------------------------------------------------
# fetch: copy every runtime jar of the pom into $LIBS, with Maven when it is installed, else with
# curl from Maven Central using jars.lock (exact versions and SHA-256 sums, written by `lock`).
# A marker file written last makes a finished copy recognisable; the copy goes to a temporary
# directory first and is renamed into place, so an interrupted or concurrent fetch never leaves
# a half-filled $LIBS.
LOCK="$HERE/jars.lock"
MAVEN_CENTRAL="${MAVEN_CENTRAL_URL:-https://repo.maven.apache.org/maven2}"

fetch_with_maven() {  # fetch_with_maven DIR
    mvn -q -B -Dstyle.color=never -f "$POM" "-Dkafka.version=$KAFKA_VERSION" \
        dependency:copy-dependencies -DincludeScope=runtime "-DoutputDirectory=$1" >&2
}

fetch_with_curl() {  # fetch_with_curl DIR
    [[ -f "$LOCK" ]] || die "no $LOCK to fetch from without Maven"
    local locked
    locked="$(sed -n 's/^kafka.version=//p' "$LOCK")"
    [[ "$locked" == "$KAFKA_VERSION" ]] \
        || die "jars.lock pins Kafka $locked, not $KAFKA_VERSION; install Maven or run 'kafka.sh lock'"
    command -v curl >/dev/null || die "neither Maven nor curl is installed; one of them is needed once to fetch the Kafka jars"
    local coords sum group artifact version jar
    while read -r coords sum; do
        [[ -z "$coords" || "$coords" == \#* || "$coords" == kafka.version=* ]] && continue
        IFS=: read -r group artifact version <<<"$coords"
        jar="$artifact-$version.jar"
        curl -fsSL --retry 3 -o "$1/$jar" "$MAVEN_CENTRAL/${group//.//}/$artifact/$version/$jar" \
            || die "download of $coords from $MAVEN_CENTRAL failed"
        echo "$sum  $1/$jar" | sha256sum -c --quiet - >&2 || die "checksum mismatch for $jar"
    done <"$LOCK"
}

cmd_fetch() {
    if [[ -f "$LIBS/.complete" ]]; then
        return 0
    fi
    command -v "$JAVA" >/dev/null || die "Java 17+ is needed to run Kafka $KAFKA_VERSION; install it (e.g. apt-get install openjdk-17-jre-headless)"
    local parent tmp
    parent="$(dirname "$LIBS")"
    mkdir -p "$parent"
    tmp="$(mktemp -d "$parent/libs.tmp.XXXXXX")"
    echo "kafka.sh: fetching Apache Kafka $KAFKA_VERSION jars into $LIBS" >&2
    local method="${TOKENMILL_KAFKA_FETCH:-auto}"  # auto | maven | curl
    [[ "$method" == auto || "$method" == maven || "$method" == curl ]] \
        || die "TOKENMILL_KAFKA_FETCH must be auto, maven or curl (got '$method')"
    if [[ "$method" == auto ]]; then
        method=curl
        command -v mvn >/dev/null && method=maven
    fi
    if [[ "$method" == maven ]]; then
        fetch_with_maven "$tmp" || { rm -rf "$tmp"; die "Maven could not fetch org.apache.kafka:kafka_2.13:$KAFKA_VERSION (see the output above)"; }
    else
        ( fetch_with_curl "$tmp" ) || { rm -rf "$tmp"; die "fetching the jars listed in $LOCK failed"; }
    fi
    ls "$tmp"/kafka_2.13-*.jar >/dev/null 2>&1 || { rm -rf "$tmp"; die "no kafka_2.13 jar after the fetch"; }
    date -u +%FT%TZ >"$tmp/.complete"
    # A directory without the marker is the remains of a copy made some other way: replace it.
    [[ -d "$LIBS" && ! -f "$LIBS/.complete" ]] && rm -rf "$LIBS"
    if ! mv -T "$tmp" "$LIBS" 2>/dev/null; then
        # Another fetch finished first; its copy is as good as ours.
        rm -rf "$tmp"
        [[ -f "$LIBS/.complete" ]] || die "could not move the jars into $LIBS"
    fi
}

# lock: resolve the pom with Maven and write jars.lock (coordinates and SHA-256 of every jar),
# so that machines without Maven can fetch exactly the same files.
cmd_lock() {
    command -v mvn >/dev/null || die "lock needs Maven"
    local work list
    work="$(mktemp -d)"
    list="$work/list.txt"
    mvn -q -B -Dstyle.color=never -f "$POM" "-Dkafka.version=$KAFKA_VERSION" dependency:list \
        -DincludeScope=runtime -DoutputAbsoluteArtifactFilename=true "-DoutputFile=$list" >&2 \
        || { rm -rf "$work"; die "Maven could not resolve $POM"; }
    {
        echo "# Runtime jars of deploy/kafka/pom.xml with their SHA-256, written by 'kafka.sh lock'."
        echo "# 'kafka.sh fetch' downloads these from Maven Central when Maven is not installed."
        echo "kafka.version=$KAFKA_VERSION"
        # Lines look like: group:artifact:jar:version:scope:/abs/path.jar [-- module ...]
        sed -n 's/^ *\([^: ]*\):\([^: ]*\):jar:\([^: ]*\):[a-z]*:\([^ ]*\.jar\).*/\1:\2:\3 \4/p' "$list" |
            while read -r coords path; do
                echo "$coords $(sha256sum "$path" | cut -d' ' -f1)"
            done | sort
    } >"$work/jars.lock"
    local count
    count="$(grep -c '^[a-z].*:.* [0-9a-f]\{64\}$' "$work/jars.lock" || true)"
    [[ "$count" -gt 0 ]] || { rm -rf "$work"; die "lock: no jars found in Maven's list"; }
    mv "$work/jars.lock" "$LOCK"
    rm -rf "$work"
    echo "kafka.sh: wrote $LOCK ($count jars)" >&2
}

# ---------------------------------------------------------------------------------------------
# Helpers for a node's data directory.

pid_file() { echo "$1/kafka.pid"; }

# The pid of the node of data directory $1 if that process is alive and is really its Kafka
# (a stale pid file whose number was reused by another process does not count).
running_pid() {
    local dir="$1" pid
    [[ -f "$(pid_file "$dir")" ]] || return 1
    pid="$(cat "$(pid_file "$dir")" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$dir/server.properties" || return 1
    echo "$pid"
}

# Alive and not a zombie: a JVM that died during start-up stays a zombie child of this script
# until it is reaped, and kill -0 succeeds on zombies.
proc_alive() {
    local state
    state="$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null || true)"
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() {
    if command -v python3 >/dev/null; then
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
        return
    fi
    local p
    for _ in $(seq 1 50); do
        p=$((20000 + RANDOM % 40000))
        port_open "$p" || { echo "$p"; return; }
    done
    die "could not find a free port"
}

read_port() {  # read_port DATA_DIR KEY -> value from D/ports, empty if none
    [[ -f "$1/ports" ]] || return 0
    sed -n "s/^$2=//p" "$1/ports" | head -n1
}

new_cluster_id() {
    # A Kafka Uuid: 16 random bytes, URL-safe base64 without padding (22 characters). One id in
    # 64 would start with '-', which the storage tool's argument parser takes for an option (and
    # then fails with "--cluster-id: expected one argument"); like Kafka's own Uuid.randomUuid we
    # draw again until it does not.
    local id
    while :; do
        id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
        [[ "$id" == -* ]] || { echo "$id"; return; }
    done
}

log_tail() {
    echo "---- last lines of $1 ----" >&2
    tail -n "${2:-40}" "$1" >&2 2>/dev/null || true
    echo "----" >&2
}

# ---------------------------------------------------------------------------------------------
# Class-data sharing: the JVM spends most of Kafka's start-up loading and verifying classes. The
# first node that stops cleanly dumps the classes it loaded into an archive next to the jars;
# later starts map it (measured: the format step 3.6 s -> 1.9 s on two busy cores). The archive
# belongs to one JVM build, so its name carries the JVM's identity; a JVM that cannot use an
# archive just ignores it. TOKENMILL_KAFKA_CDS=0 turns this off.
cds_archive() {
    local java_bin id
    java_bin="$(readlink -f "$(command -v "$JAVA")")"
    id="$(printf '%s %s' "$java_bin" "$(stat -c %Y "$java_bin")" | cksum | cut -d' ' -f1)"
    echo "$(dirname "$LIBS")/cds-$id.jsa"
}

# The JVM options for class-data sharing, for the node in data directory $1: use the archive when
# there is one; otherwise have this run write one at exit (renamed into place by `stop`).
cds_options() {
    [[ "${TOKENMILL_KAFKA_CDS:-1}" != 0 ]] || return 0
    local archive
    archive="$(cds_archive)"
    if [[ -s "$archive" ]]; then
        echo "-XX:SharedArchiveFile=$archive -Xlog:cds=off -Xlog:cds+dynamic=off"
    else
        echo "$archive" >"$1/cds.pending"
        echo "-XX:ArchiveClassesAtExit=$1/cds.jsa -Xlog:cds=off -Xlog:cds+dynamic=off"
    fi
}

# After the node of data directory $1 has exited: publish the archive it wrote, if any.
cds_publish() {
    local dir="$1" target
    [[ -f "$dir/cds.pending" ]] || return 0
    target="$(cat "$dir/cds.pending")"
    rm -f "$dir/cds.pending"
    if [[ -s "$dir/cds.jsa" && ! -e "$target" ]]; then
        mv -f "$dir/cds.jsa" "$target.tmp.$$" && mv -f "$target.tmp.$$" "$target"
    fi
    rm -f "$dir/cds.jsa"
}

# ---------------------------------------------------------------------------------------------
# TLS files for --sasl-ssl, made with Java's keytool: a certificate authority of our own, and a
# broker key and certificate signed by it for 127.0.0.1 and localhost. T gets ca.pem (what clients
# trust: --ssl-cafile), broker.keystore.p12 (the broker's key with its certificate chain),
# truststore.p12 (the CA, for the broker's connections to itself), ca.p12 (the CA's key, to sign
# more) and store.password (the password of the stores). Only the owner can read them. A
# directory that already has them is left as it is.
cmd_tls() {
    local dir="" days=30
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --dir) dir="$2"; shift 2 ;;
            --days) days="$2"; shift 2 ;;
            *) die "tls: unknown argument '$1'" ;;
        esac
    done
    [[ -n "$dir" ]] || die "tls: --dir is required"
    [[ "$days" =~ ^[1-9][0-9]*$ ]] || die "tls: --days takes a positive number (got '$days')"
    command -v keytool >/dev/null || die "tls: keytool is needed (it comes with Java 17+)"
    umask 077
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    local f missing=0
    for f in ca.pem ca.p12 broker.keystore.p12 truststore.p12 store.password; do
        [[ -s "$dir/$f" ]] || missing=1
    done
    if [[ "$missing" == 0 ]]; then
        echo "kafka.sh: TLS files already in $dir"
        return 0
    fi
    local tmp password
    tmp="$(mktemp -d "$dir/tls.tmp.XXXXXX")"
    password="$(head -c 18 /dev/urandom | base64 | tr -d '+/=\n')"
    printf '%s\n' "$password" >"$tmp/store.password"
    local kt=(keytool -noprompt -storetype PKCS12 -storepass "$password")
    local san="SAN=ip:127.0.0.1,dns:localhost"
    if ! {
        "${kt[@]}" -genkeypair -keystore "$tmp/ca.p12" -alias ca -keyalg RSA -keysize 2048 -validity "$days" \
            -dname "CN=tokenmill local CA" -ext bc:c -ext ku:c=keyCertSign,cRLSign &&
        "${kt[@]}" -exportcert -keystore "$tmp/ca.p12" -alias ca -rfc -file "$tmp/ca.pem" &&
        "${kt[@]}" -genkeypair -keystore "$tmp/broker.keystore.p12" -alias broker -keyalg RSA -keysize 2048 \
            -validity "$days" -dname "CN=localhost" -ext "$san" &&
        "${kt[@]}" -certreq -keystore "$tmp/broker.keystore.p12" -alias broker -file "$tmp/broker.csr" &&
        "${kt[@]}" -gencert -keystore "$tmp/ca.p12" -alias ca -infile "$tmp/broker.csr" -outfile "$tmp/broker.pem" \
            -rfc -validity "$days" -ext "$san" -ext ku:c=digitalSignature,keyEncipherment -ext eku=serverAuth &&
        "${kt[@]}" -importcert -keystore "$tmp/broker.keystore.p12" -alias ca -file "$tmp/ca.pem" &&
        "${kt[@]}" -importcert -keystore "$tmp/broker.keystore.p12" -alias broker -file "$tmp/broker.pem" &&
        "${kt[@]}" -importcert -keystore "$tmp/truststore.p12" -alias ca -file "$tmp/ca.pem"
    } >"$tmp/keytool.log" 2>&1; then
        cat "$tmp/keytool.log" >&2
        rm -rf "$tmp"
        die "tls: keytool failed (output above)"
    fi
    for f in ca.pem ca.p12 broker.keystore.p12 truststore.p12 store.password; do
        mv -f "$tmp/$f" "$dir/$f"
    done
    rm -rf "$tmp"
    echo "kafka.sh: TLS files in $dir (CA: $dir/ca.pem)"
}

# SCRAM users of a --scram-users file as "name password" lines. Names and passwords are limited
# to characters that need no quoting in the storage tool's [name=...,password=...] syntax.
scram_users() {  # scram_users FILE
    local line name password
    while IFS= read -r line || [[ -n "$line" ]]; do
        [[ -z "$line" || "$line" == \#* ]] && continue
        name="${line%%=*}"
        password="${line#*=}"
        [[ "$name" =~ ^[A-Za-z0-9._-]+$ && "$password" =~ ^[A-Za-z0-9._~-]+$ && "$line" == *=* ]] \
            || die "start: $1: each line is name=password, from the characters A-Z a-z 0-9 . _ - (and ~ in passwords)"
        echo "$name $password"
    done <"$1"
}

# The SASL_SSL overlay: render server-sasl-ssl.properties.template and let its keys replace
# those of the same name in the plain configuration already written to PROPS.
apply_sasl_ssl() {  # apply_sasl_ssl PROPS TLS_DIR USERS_FILE SUPER_USER PORT CONTROLLER_PORT
    local props="$1" tls="$2" users="$3" super="$4" super_password store_password overlay merged
    store_password="$(head -n1 "$tls/store.password")"
    super_password="$(scram_users "$users" | awk -v u="$super" '$1 == u { print $2; exit }')"
    [[ -n "$super_password" ]] || die "start: the super user '$super' is not in $users"
    overlay="$(sed -e "s|@PORT@|$5|g" -e "s|@CONTROLLER_PORT@|$6|g" -e "s|@TLS_DIR@|$tls|g" \
        -e "s|@STORE_PASSWORD@|$store_password|g" -e "s|@SUPER_USER@|$super|g" \
        -e "s|@SUPER_PASSWORD@|$super_password|g" "$HERE/server-sasl-ssl.properties.template")"
    merged="$(awk -F= 'NR == FNR { if ($0 ~ /^[a-z]/) set[$1] = 1; next } !($1 in set)' \
        <(printf '%s\n' "$overlay") "$props")"
    printf '%s\n\n%s\n' "$merged" "$overlay" >"$props"
    chmod 600 "$props"  # it holds the super user's password
}

# ---------------------------------------------------------------------------------------------
cmd_start() {
    local port="" dir="" cport="" timeout=120 owner="" auto_create=true tls_dir="" users_file="" super_user=admin
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --data-dir) dir="$2"; shift 2 ;;
            --controller-port) cport="$2"; shift 2 ;;
            --timeout) timeout="$2"; shift 2 ;;
            --owner-pid) owner="$2"; shift 2 ;;
            --auto-create-topics) auto_create="$2"; shift 2 ;;
            --sasl-ssl) tls_dir="$2"; shift 2 ;;
            --scram-users) users_file="$2"; shift 2 ;;
            --super-user) super_user="$2"; shift 2 ;;
            *) die "start: unknown argument '$1'" ;;
        esac
    done
    [[ -n "$dir" ]] || die "start: --data-dir is required"
    if [[ -n "$tls_dir" ]]; then
        [[ -s "$tls_dir/broker.keystore.p12" && -s "$tls_dir/store.password" ]] \
            || die "start: no TLS files in '$tls_dir' (make them with: kafka.sh tls --dir $tls_dir)"
        tls_dir="$(cd "$tls_dir" && pwd)"
        [[ -n "$users_file" && -f "$users_file" ]] || die "start: --sasl-ssl needs --scram-users FILE (name=password lines)"
        scram_users "$users_file" >/dev/null  # refuses a malformed file here, in this shell
    elif [[ -n "$users_file" ]]; then
        die "start: --scram-users goes with --sasl-ssl"
    fi
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    # A restart reuses the ports recorded at first start unless told otherwise.
    [[ -n "$port" ]] || port="$(read_port "$dir" port)"
    [[ -n "$port" ]] || port=9092
    local recorded_cport
    recorded_cport="$(read_port "$dir" controller_port)"
    if [[ -n "$recorded_cport" ]]; then
        if [[ -n "$cport" && "$cport" != "$recorded_cport" ]]; then
            die "start: $dir was formatted with controller port $recorded_cport; the single-node quorum keeps that endpoint, so --controller-port $cport cannot be used (omit it)"
        fi
        cport="$recorded_cport"
    fi
    [[ -n "$cport" ]] || cport="$(free_port)"
    [[ "$port" =~ ^[0-9]+$ && "$cport" =~ ^[0-9]+$ ]] || die "start: ports must be numbers (got '$port', '$cport')"
    [[ "$auto_create" == true || "$auto_create" == false ]] || die "start: --auto-create-topics takes true or false (got '$auto_create')"
    [[ "$port" != "$cport" ]] || die "start: broker and controller ports must differ (both $port)"

    local pid
    if pid="$(running_pid "$dir")"; then
        local running_port
        running_port="$(read_port "$dir" port)"
        if [[ "$running_port" == "$port" ]]; then
            echo "kafka already running: pid $pid, bootstrap 127.0.0.1:$port, data $dir"
            return 0
        fi
        die "start: a Kafka node (pid $pid) already runs on $dir with port $running_port"
    fi
    for p in "$port" "$cport"; do
        port_open "$p" && die "start: port $p on 127.0.0.1 is already in use"
    done

    cmd_fetch

    local log_dir="$dir/log" props="$dir/server.properties" log="$dir/kafka.log"
    sed -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$cport|g" -e "s|@LOG_DIR@|$log_dir|g" \
        -e "s|@AUTO_CREATE@|$auto_create|g" \
        "$HERE/server.properties.template" >"$props"
    local scram_args=() name password
    if [[ -n "$tls_dir" ]]; then
        apply_sasl_ssl "$props" "$tls_dir" "$users_file" "$super_user" "$port" "$cport"
        while read -r name password; do
            scram_args+=(--add-scram "SCRAM-SHA-512=[name=$name,password=$password]")
        done < <(scram_users "$users_file")
    fi
    printf 'port=%s\ncontroller_port=%s\nkafka_version=%s\n' "$port" "$cport" "$KAFKA_VERSION" >"$dir/ports"

    local heap="${KAFKA_HEAP_OPTS:--Xms128m -Xmx512m}"
    # Serial GC and the C1 compiler start fastest and stay out of the way on two shared cores.
    local jvm="${KAFKA_JVM_OPTS:--XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true}"
    local cp="$LIBS/*"
    # shellcheck disable=SC2206
    local java_cmd=("$JAVA" $heap $jvm "-Dlog4j2.configurationFile=$HERE/log4j2.properties" -cp "$cp")
    local cds_use="" archive
    archive="$(cds_archive)"
    if [[ "${TOKENMILL_KAFKA_CDS:-1}" != 0 && -s "$archive" ]]; then
        cds_use="-XX:SharedArchiveFile=$archive -Xlog:cds=off -Xlog:cds+dynamic=off"
    fi

    if [[ ! -f "$log_dir/meta.properties" ]]; then
        echo "kafka.sh: formatting KRaft storage in $log_dir" >&2
        # shellcheck disable=SC2086
        if ! "${java_cmd[@]}" $cds_use kafka.tools.StorageTool format --standalone \
                -t "$(new_cluster_id)" -c "$props" ${scram_args[@]+"${scram_args[@]}"} >>"$log" 2>&1; then
            log_tail "$log"
            die "start: formatting the storage failed"
        fi
    fi

    echo "=== start $(date -u +%FT%TZ) port=$port controller_port=$cport" >>"$log"
    # setsid: the node outlives this script and is not hit by the caller's terminal signals.
    # The inner shell writes its own pid, then exec turns it into the JVM (same pid).
    local pf marker_line
    pf="$(pid_file "$dir")"
    rm -f "$pf"
    marker_line="$(grep -c '' "$log")"
    local cds_run
    cds_run="$(cds_options "$dir")"
    # shellcheck disable=SC2086,SC2016  # $cds_run is a word list; $$ and $0 belong to the inner shell
    setsid bash -c 'echo $$ >"$0"; exec "$@"' "$pf" "${java_cmd[@]}" $cds_run kafka.Kafka "$props" \
        </dev/null >>"$log" 2>&1 &
    local deadline=$((SECONDS + timeout))
    while [[ ! -s "$pf" ]]; do
        ((SECONDS < deadline)) || die "start: the JVM did not start (log: $log)"
        sleep 0.1
    done
    pid="$(cat "$pf")"

    # Ready = the server reports "Kafka Server started" (the broker is registered and unfenced)
    # after our start marker, and its listener accepts connections.
    while true; do
        if ! proc_alive "$pid"; then
            log_tail "$log" 60
            rm -f "$pf"
            die "start: Kafka exited during start-up (log: $log)"
        fi
        if tail -n "+$marker_line" "$log" | grep -q 'Kafka Server started' && port_open "$port"; then
            break
        fi
        if ((SECONDS >= deadline)); then
            log_tail "$log" 60
            kill -TERM "$pid" 2>/dev/null || true
            die "start: Kafka did not answer on 127.0.0.1:$port within ${timeout}s (log: $log)"
        fi
        sleep 0.2
    done

    if [[ -n "$owner" ]]; then
        # Stop the node when the owning process goes away, even if it dies without cleaning up.
        setsid nohup bash "$0" _watch --data-dir "$dir" --owner-pid "$owner" --pid "$pid" \
            </dev/null >>"$log" 2>&1 &
    fi
    echo "kafka running: pid $pid, bootstrap 127.0.0.1:$port, data $dir"
}

cmd__watch() {
    local dir="" owner="" pid=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --data-dir) dir="$2"; shift 2 ;;
            --owner-pid) owner="$2"; shift 2 ;;
            --pid) pid="$2"; shift 2 ;;
            *) die "_watch: unknown argument '$1'" ;;
        esac
    done
    while proc_alive "$owner" && proc_alive "$pid"; do
        sleep 1
    done
    if proc_alive "$pid" && [[ "$(running_pid "$dir" || true)" == "$pid" ]]; then
        echo "kafka.sh: owner process $owner is gone; stopping Kafka pid $pid" >&2
        cmd_stop --data-dir "$dir"
    fi
}

cmd_status() {
    local dir=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --data-dir) dir="$2"; shift 2 ;;
            *) die "status: unknown argument '$1'" ;;
        esac
    done
    [[ -n "$dir" ]] || die "status: --data-dir is required"
    [[ -d "$dir" ]] || { echo "kafka stopped: no data directory $dir"; return 3; }
    dir="$(cd "$dir" && pwd)"
    local pid port
    port="$(read_port "$dir" port)"
    if pid="$(running_pid "$dir")"; then
        if port_open "$port"; then
            echo "kafka running: pid $pid, bootstrap 127.0.0.1:$port, data $dir"
            return 0
        fi
        echo "kafka not answering: pid $pid alive but 127.0.0.1:$port refuses connections, data $dir"
        return 4
    fi
    echo "kafka stopped: data $dir"
    return 3
}

cmd_stop() {
    local dir="" timeout=60
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --data-dir) dir="$2"; shift 2 ;;
            --timeout) timeout="$2"; shift 2 ;;
            *) die "stop: unknown argument '$1'" ;;
        esac
    done
    [[ -n "$dir" ]] || die "stop: --data-dir is required"
    [[ -d "$dir" ]] || { echo "kafka stopped: no data directory $dir"; return 0; }
    dir="$(cd "$dir" && pwd)"
    local pid
    if ! pid="$(running_pid "$dir")"; then
        rm -f "$(pid_file "$dir")"
        echo "kafka stopped: data $dir"
        return 0
    fi
    # SIGTERM runs Kafka's shutdown hook: a controlled shutdown that flushes and closes the logs,
    # so the next start needs no log recovery.
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + timeout))
    while proc_alive "$pid"; do
        if ((SECONDS >= deadline)); then
            echo "kafka.sh: pid $pid ignored SIGTERM for ${timeout}s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
            rm -f "$dir/cds.pending" "$dir/cds.jsa"  # an archive cut off mid-write is no use
            sleep 0.5
            break
        fi
        sleep 0.2
    done
    rm -f "$(pid_file "$dir")"
    cds_publish "$dir"
    echo "kafka stopped: data $dir"
}

main() {
    local cmd="${1:-}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        fetch) cmd_fetch "$@" ;;
        lock) cmd_lock "$@" ;;
        libs) cmd_fetch && echo "$LIBS" ;;
        start) cmd_start "$@" ;;
        tls) cmd_tls "$@" ;;
        status) cmd_status "$@" ;;
        stop) cmd_stop "$@" ;;
        _watch) cmd__watch "$@" ;;
        version) echo "$KAFKA_VERSION" ;;
        -h|--help|help|"")
            awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
            [[ -n "$cmd" ]] ;;
        *) die "unknown command '$cmd' (fetch, lock, start, status, stop, tls, libs, version)" ;;
    esac
}

main "$@"
