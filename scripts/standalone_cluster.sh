#!/usr/bin/env bash
# A real Spark standalone cluster on this machine: one master and N workers (default 2),
# started from the pip-installed pyspark and bound to 127.0.0.1; runs one command against
# it; stops every process it started when it exits, whatever happens.
#
#   scripts/standalone_cluster.sh                      # sparknet train --model lenet --dataset mnist --workers 2
#   scripts/standalone_cluster.sh -- python job.py     # any command; it finds the master in $SPARKNET_MASTER
#   scripts/standalone_cluster.sh --workers 3 --memory 2g -- sparknet train --workers 3 --master '$SPARKNET_MASTER'
#
# Options (before --):
#   --workers N        workers to start (default 2)
#   --cores C          cores each worker offers (default 1)
#   --memory M         memory each worker offers to executors (default 1g)
#   --dir DIR          folder for logs, pids and work folders (default: a new temporary folder)
#   --keep             keep that folder at exit (it is always kept when the command fails)
#   --timeout S        seconds to wait for the master and every worker to come up (default 120)
#
# The command runs with these variables set:
#   SPARKNET_MASTER      spark://127.0.0.1:PORT
#   SPARKNET_MASTER_UI   http://127.0.0.1:UIPORT (the master's web UI; /json/ lists workers and apps)
#   SPARKNET_CLUSTER_DIR the folder above
#   PYSPARK_PYTHON       the Python that has pyspark (executors use it too)
# A literal '$SPARKNET_MASTER' in the command's arguments is replaced by the URL.
#
# The exit status is the command's. Environment: PYTHON (default python3) picks the Python whose
# pyspark is used; JAVA_HOME or java on PATH (Java 17) runs Spark.
set -euo pipefail

WORKERS=2
CORES=1
MEMORY=1g
DIR=""
KEEP=0
TIMEOUT=120
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --cores) CORES="$2"; shift 2 ;;
    --memory) MEMORY="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "standalone_cluster: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "standalone_cluster: --workers must be a positive integer" >&2; exit 2; }

PY="$(command -v "${PYTHON:-python3}")" || { echo "standalone_cluster: no ${PYTHON:-python3} on PATH" >&2; exit 2; }
PY="$("$PY" -c 'import sys; print(sys.executable)')"
SPARK_HOME="$("$PY" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" || {
  echo "standalone_cluster: $PY cannot import pyspark (pip install pyspark, or set PYTHON=)" >&2; exit 2; }
export SPARK_HOME

if [[ -z "$DIR" ]]; then
  DIR="$(mktemp -d "${TMPDIR:-/tmp}/sparknet-cluster.XXXXXX")"
else
  mkdir -p "$DIR"
  DIR="$(cd "$DIR" && pwd)"
fi
mkdir -p "$DIR/logs"
: > "$DIR/pids"

PIDS=()        # the JVMs this script started: master first, then the workers
CMD_PID=""
STATUS=1

log() { echo "standalone_cluster: $*" >&2; }

stop_pid() {   # stop_pid PID NAME: TERM, wait up to 20 s, then KILL
  local pid="$1" name="$2" i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 200; i++)); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  log "$name ($pid) did not stop in 20 s; killing it"
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  [[ -n "$CMD_PID" ]] && stop_pid "$CMD_PID" "command"
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do   # workers first (they stop their executors), then the master
    stop_pid "${PIDS[$i]}" "$([[ $i -eq 0 ]] && echo master || echo "worker $i")"
  done
  # Executors run in the workers' work folders: anything still running there was started by this cluster.
  local p cwd
  for p in /proc/[0-9]*; do
    cwd="$(readlink "$p/cwd" 2>/dev/null)" || continue
    if [[ "$cwd" == "$DIR"/work* ]]; then
      log "stopping leftover executor ${p#/proc/}"
      stop_pid "${p#/proc/}" "executor"
    fi
  done
  [[ $rc -eq 0 ]] && rc=$STATUS
  if [[ $KEEP -eq 1 || $rc -ne 0 ]]; then
    log "logs kept in $DIR/logs"
  else
    rm -rf "$DIR"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }
PORT="$(free_port)"
UI_PORT="$(free_port)"
MASTER="spark://127.0.0.1:$PORT"
MASTER_UI="http://127.0.0.1:$UI_PORT"

export SPARK_LOCAL_IP=127.0.0.1
export SPARK_LOG_DIR="$DIR/logs"
export SPARK_DAEMON_MEMORY="${SPARK_DAEMON_MEMORY:-512m}"
export PYSPARK_PYTHON="$PY"
export PYSPARK_DRIVER_PYTHON="$PY"

log "master $MASTER (UI $MASTER_UI), $WORKERS workers x $CORES core(s), $MEMORY; logs in $DIR/logs"
"$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.master.Master \
  --host 127.0.0.1 --port "$PORT" --webui-port "$UI_PORT" >"$DIR/logs/master.log" 2>&1 &
PIDS+=($!)
echo "master $!" >>"$DIR/pids"

# wait_for N: until the master's JSON lists N alive workers (0: until it answers); fail fast if a JVM died.
wait_for() {
  "$PY" - "$MASTER_UI/json/" "$1" "$TIMEOUT" "${PIDS[@]}" <<'EOF'
import json, os, sys, time, urllib.request
url, want, timeout, pids = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), [int(p) for p in sys.argv[4:]]
deadline = time.monotonic() + timeout
alive = -1
while time.monotonic() < deadline:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(f"a Spark process ({pid}) exited during start-up; see its log")
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            alive = int(json.load(r).get("aliveworkers", 0))
        if alive >= want:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(f"timed out after {timeout:.0f} s waiting for {want} workers (saw {max(alive, 0)})")
EOF
}
wait_for 0 || { log "the master did not come up"; tail -n 20 "$DIR/logs/master.log" >&2; exit 1; }

for ((i = 1; i <= WORKERS; i++)); do
  mkdir -p "$DIR/work$i"
  "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker \
    --host 127.0.0.1 --cores "$CORES" --memory "$MEMORY" --webui-port 0 --work-dir "$DIR/work$i" \
    "$MASTER" >"$DIR/logs/worker$i.log" 2>&1 &
  PIDS+=($!)
  echo "worker $!" >>"$DIR/pids"
done
wait_for "$WORKERS" || {
  log "workers did not register"; for ((i = 1; i <= WORKERS; i++)); do tail -n 10 "$DIR/logs/worker$i.log" >&2; done; exit 1; }
log "cluster up: $WORKERS workers registered with $MASTER"

export SPARKNET_MASTER="$MASTER" SPARKNET_MASTER_UI="$MASTER_UI" SPARKNET_CLUSTER_DIR="$DIR"
if [[ $# -eq 0 ]]; then
  set -- sparknet train --model lenet --dataset mnist --workers "$WORKERS" --master "$MASTER"
fi
ARGS=()
for a in "$@"; do ARGS+=("${a//\$SPARKNET_MASTER/$MASTER}"); done
log "running: ${ARGS[*]}"
"${ARGS[@]}" &
CMD_PID=$!
set +e
wait "$CMD_PID"
STATUS=$?
set -e
CMD_PID=""
log "command exited with status $STATUS"
exit "$STATUS"
