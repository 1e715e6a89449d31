#!/usr/bin/env bash
# A local kvfuse cluster: N `kvfuse serve` processes sharing one Redis tier, each publishing KV
# events, with vllm-router in front. For trying the multi-server setup of docs/deploy.md on one
# machine (and for bench/cluster.py's layout); a real deployment runs one server per machine.
#
#   scripts/cluster.sh start [-n N] [--policy P] [--model M] [--base-port P] [--router-port P]
#                            [--redis-url URL] [--threads T] [--run-dir DIR]
#                            [--session-affinity SECS] [-- SERVE-ARGS...]
#   scripts/cluster.sh status [--run-dir DIR]
#   scripts/cluster.sh stop   [--run-dir DIR]
#
# start: a redis-server on 127.0.0.1 (unless --redis-url names one), then servers on ports
#   base-port, base-port+1, ... (KV events on base-port+100+i), each with --threads
#   (cores / N by default: the servers split the machine) and its own disk tier under the run
#   directory, then vllm-router on router-port with the policy (kv_aware gets every server's
#   --kv-event-source and --kv-event-block-size 16, kvfuse's server.kv_events_block_size) and
#   the failover flags (FAILOVER below; docs/deploy.md "When a server dies"). --session-affinity
#   (kv_aware only) keeps an active X-Session-ID on its server for SECS after its last request
#   (vllm-router's --kv-aware-session-affinity-ttl-secs; docs/deploy.md, which policy).
# Every process's PID goes to RUN_DIR/*.pid with its command line beside it; stop ends exactly
# those PIDs (SIGTERM, SIGKILL after 20 s), and only while the PID has the start time recorded, so
# a PID reused by another process is never touched. Logs: RUN_DIR/*.log.
# Defaults from the environment: KVFUSE_CLUSTER_DIR (/tmp/kvfuse-cluster-$USER),
# KVFUSE_VLLM_ROUTER (.baselines/router-venv/bin/vllm-router; bash bench/setup_router.sh),
# PYTHON (python3), KVFUSE_HOME.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
RUN_DIR="${KVFUSE_CLUSTER_DIR:-/tmp/kvfuse-cluster-${USER:-$(id -un)}}"
ROUTER="${KVFUSE_VLLM_ROUTER:-$REPO/.baselines/router-venv/bin/vllm-router}"
PYTHON="${PYTHON:-python3}"
N=2
POLICY=cache_aware
MODEL=smollm2
BASE_PORT=8201
ROUTER_PORT=8000
REDIS_URL=""
THREADS=""
AFFINITY=""
BLOCK=16
SERVE_ARGS=()
# vllm-router's failover flags, as bench/lib/cluster.py's ROUTER_FAILOVER (a unit test keeps the
# two equal): a worker's first failed attempt opens its circuit, so the router's retry of that
# request goes to another worker; health checks every second keep a dead one out.
FAILOVER=(--cb-failure-threshold 1 --cb-timeout-duration-secs 5 --health-check-interval-secs 1
          --health-failure-threshold 2 --health-check-timeout-secs 2 --retry-max-retries 5)

die() { echo "cluster.sh: $*" >&2; exit 2; }

parse() {
    while [ $# -gt 0 ]; do
        case "$1" in
            -n) N="$2"; shift 2 ;;
            --policy) POLICY="$2"; shift 2 ;;
            --model) MODEL="$2"; shift 2 ;;
            --base-port) BASE_PORT="$2"; shift 2 ;;
            --router-port) ROUTER_PORT="$2"; shift 2 ;;
            --redis-url) REDIS_URL="$2"; shift 2 ;;
            --threads) THREADS="$2"; shift 2 ;;
            --run-dir) RUN_DIR="$2"; shift 2 ;;
            --session-affinity) AFFINITY="$2"; shift 2 ;;
            --) shift; SERVE_ARGS=("$@"); break ;;
            *) die "unknown argument: $1" ;;
        esac
    done
    if [ -n "$AFFINITY" ] && [ "$POLICY" != kv_aware ]; then
        die "--session-affinity is a kv_aware option (got --policy $POLICY)"
    fi
}

# A PID file holds the PID, its start time (field 22 of /proc/PID/stat, which a reused PID does
# not share) and the command line, one a line.
started() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }

alive() {  # alive NAME: true while the recorded PID is still the process started
    local f="$RUN_DIR/$1.pid" pid
    [ -f "$f" ] || return 1
    pid="$(sed -n 1p "$f")"
    [ -n "$pid" ] && [ "$(started "$pid")" = "$(sed -n 2p "$f")" ]
}

launch() {  # launch NAME CMD...: start in the background, record PID, start time, command
    local name="$1"; shift
    "$@" > "$RUN_DIR/$name.log" 2>&1 &
    printf '%s\n%s\n%s\n' "$!" "$(started "$!")" "$*" > "$RUN_DIR/$name.pid"
}

wait_http() {  # wait_http NAME URL SECONDS
    local deadline=$((SECONDS + $3))
    until curl -fsS -o /dev/null --max-time 2 "$2" 2>/dev/null; do
        alive "$1" || die "$1 exited; see $RUN_DIR/$1.log"
        [ $SECONDS -lt $deadline ] || die "$1 did not answer $2 within $3 s; see $RUN_DIR/$1.log"
        sleep 0.5
    done
}

start_redis() {
    if [ -n "$REDIS_URL" ]; then return; fi
    local port=$((BASE_PORT + 300))
    launch redis redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no
    REDIS_URL="redis://127.0.0.1:$port/0"
    for _ in $(seq 50); do
        redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && return
        sleep 0.1
    done
    die "redis-server did not answer on port $port; see $RUN_DIR/redis.log"
}

start_servers() {
    local cores i port
    cores="$(nproc)"
    THREADS="${THREADS:-$(( cores / N > 0 ? cores / N : 1 ))}"
    for i in $(seq 0 $((N - 1))); do
        port=$((BASE_PORT + i))
        cat > "$RUN_DIR/server-$i.yaml" <<EOF
model: $MODEL
cache: {redis_url: "$REDIS_URL", disk_path: "$RUN_DIR/disk-$i"}
server: {kv_events_block_size: $BLOCK}
EOF
        OMP_NUM_THREADS="$THREADS" launch "server-$i" "$PYTHON" -m kvfuse.cli serve \
            --host 127.0.0.1 --port "$port" --config "$RUN_DIR/server-$i.yaml" \
            --threads "$THREADS" --kv-events "tcp://127.0.0.1:$((port + 100))" \
            ${SERVE_ARGS[@]+"${SERVE_ARGS[@]}"}
    done
    for i in $(seq 0 $((N - 1))); do
        wait_http "server-$i" "http://127.0.0.1:$((BASE_PORT + i))/health" 600
    done
}

start_router() {
    [ -x "$ROUTER" ] || die "no vllm-router at $ROUTER: bash bench/setup_router.sh"
    local urls=() sources=() i port
    for i in $(seq 0 $((N - 1))); do
        port=$((BASE_PORT + i))
        urls+=("http://127.0.0.1:$port")
        sources+=(--kv-event-source "http://127.0.0.1:$port=tcp://127.0.0.1:$((port + 100))")
    done
    local extra=()
    if [ "$POLICY" = kv_aware ]; then
        extra=("${sources[@]}" --kv-event-block-size "$BLOCK" --kv-event-model "$MODEL")
        [ -z "$AFFINITY" ] || extra+=(--kv-aware-session-affinity-ttl-secs "$AFFINITY")
    fi
    launch router "$ROUTER" --host 127.0.0.1 --port "$ROUTER_PORT" --policy "$POLICY" \
        --worker-urls "${urls[@]}" "${FAILOVER[@]}" ${extra[@]+"${extra[@]}"}
    wait_http router "http://127.0.0.1:$ROUTER_PORT/health" 60
}

cmd_start() {
    mkdir -p "$RUN_DIR"
    for f in "$RUN_DIR"/*.pid; do
        [ -e "$f" ] || continue
        alive "$(basename "$f" .pid)" && die "a cluster runs in $RUN_DIR: stop it first"
    done
    rm -f "$RUN_DIR"/*.pid
    start_redis
    start_servers
    start_router
    cmd_status
    echo "router: http://127.0.0.1:$ROUTER_PORT/v1 (policy $POLICY); stop: $0 stop --run-dir $RUN_DIR"
}

cmd_status() {
    local f name
    for f in "$RUN_DIR"/*.pid; do
        [ -e "$f" ] || { echo "no cluster in $RUN_DIR"; return 0; }
        name="$(basename "$f" .pid)"
        if alive "$name"; then
            echo "$name: running (pid $(sed -n 1p "$f"))"
        else
            echo "$name: not running"
        fi
    done
}

stop_one() {  # stop_one NAME
    local f="$RUN_DIR/$1.pid" pid
    if alive "$1"; then
        pid="$(sed -n 1p "$f")"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 40); do alive "$1" || break; sleep 0.5; done
        if alive "$1"; then kill -KILL "$pid" 2>/dev/null || true; fi
        echo "$1: stopped (pid $pid)"
    fi
    rm -f "$f"
}

cmd_stop() {
    local f
    [ -e "$RUN_DIR/router.pid" ] && stop_one router
    for f in "$RUN_DIR"/server-*.pid; do
        [ -e "$f" ] && stop_one "$(basename "$f" .pid)"
    done
    [ -e "$RUN_DIR/redis.pid" ] && stop_one redis
    return 0
}

[ $# -ge 1 ] || die "usage: $0 start|stop|status [options]"
sub="$1"; shift
parse "$@"
case "$sub" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) die "unknown subcommand: $sub (start, stop, status)" ;;
esac
