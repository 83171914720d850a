#!/usr/bin/env bash
# Starts the server N × CONC times (CONC at once, `--shards SHARDS`), each until it logs
# `listening_grpc` or LIMIT seconds pass, and counts the starts that did not get there. A start
# that hangs has its threads' wait channels and a gdb backtrace of every thread saved beside its
# log (when gdb is installed), then is killed. Bounded: N rounds, LIMIT seconds per start.
#   perf/startup_stress.sh BIN [N=25] [CONC=4] [SHARDS=2] [LIMIT=10]
set -uo pipefail
bin=$1 rounds=${2:-25} conc=${3:-4} shards=${4:-2} limit=${5:-10}
out=$(mktemp -d)
one() {
  local i=$1 log="$out/$1.log"
  "$bin" --grpc-bind-address 127.0.0.1:0 --http-bind-address 127.0.0.1:0 \
    --snapshot-bind-address 127.0.0.1:0 --shards "$shards" --log-level info \
    --insecure-disable-auth >/dev/null 2>"$log" &
  local pid=$!
  for _ in $(seq 1 $((limit * 10))); do
    grep -q listening_grpc "$log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if grep -q listening_grpc "$log"; then
    echo ok
  else
    echo "HUNG $i"
    for t in /proc/$pid/task/*; do
      echo "$(cat "$t/comm") $(cut -d' ' -f3 "$t/stat") $(cat "$t/wchan" 2>/dev/null)"
    done >"$out/$i.threads" 2>&1
    command -v gdb >/dev/null &&
      timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt 25" >"$out/$i.gdb" 2>&1
  fi
  kill -TERM "$pid" 2>/dev/null
  sleep 1
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}
for r in $(seq 1 "$rounds"); do
  for j in $(seq 1 "$conc"); do one "$r-$j" & done
  wait
done | sort | uniq -c
echo "logs: $out"
