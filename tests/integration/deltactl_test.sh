#!/usr/bin/env bash
# deltactl against a real deltad on simulated GPUs: every command, its exit
# code and the error when the daemon is gone.
#   deltactl_test.sh path/to/deltad path/to/deltactl
set -euo pipefail
deltad=$1
deltactl=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/deltactl_test.XXXXXX")
sock=$dir/d.sock
pid=
cleanup() {
  if [[ -n $pid ]]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  echo "--- stdout" >&2; cat "$dir/out" >&2 || true
  echo "--- stderr" >&2; cat "$dir/err" >&2 || true
  exit 1
}

# Runs deltactl; its exit code lands in $rc, its output in $dir/out, err.
ctl() {
  rc=0
  "$deltactl" --socket="$sock" --timeout=5s "$@" >"$dir/out" 2>"$dir/err" || rc=$?
}
expect_rc() { [[ $rc == "$1" ]] || fail "deltactl ${*:2}: exit $rc, wanted $1"; }
expect_out() { grep -qF -- "$1" "$dir/out" || fail "stdout lacks '$1'"; }
expect_err() { grep -qF -- "$1" "$dir/err" || fail "stderr lacks '$1'"; }

# An empty configuration file: nothing on this machine changes the daemon.
: >"$dir/deltad.conf"
"$deltad" --config="$dir/deltad.conf" --socket="$sock" --backend=sim \
  --sim_gpus=2 --sim_memory=16GiB --metrics=127.0.0.1:0 --host_pool=1GiB \
  --host_slab=64MiB --drain_seconds=1 2>"$dir/deltad.log" &
pid=$!

for _ in $(seq 100); do
  ctl health
  [[ $rc == 0 ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$dir/deltad.log" >&2; fail "deltad exited"; }
  sleep 0.1
done
expect_rc 0 health
expect_out SERVING

ctl status
expect_rc 0 status
expect_out "sim backend, at unix:$sock"
expect_out "host pool: 1.0 GiB, 0 B granted"
expect_out "GPU  NAME"
expect_out "CHUNKS"
expect_out "16.0 GiB"
[[ $(grep -c GiB "$dir/out") -ge 3 ]] || fail "status: not a line per GPU"

ctl sessions
expect_rc 0 sessions
expect_out "no sessions"

ctl top 42
expect_rc 1 top 42
expect_err "NOT_FOUND"
expect_err "no session 42"

ctl top 42 5000
expect_rc 2 top 42 5000
ctl top abc
expect_rc 2 top abc
ctl status extra
expect_rc 2 status extra
ctl frobnicate
expect_rc 2 frobnicate
expect_err 'unknown command "frobnicate"'
ctl
expect_rc 2 "(no command)"

kill -TERM "$pid"
wait "$pid" || true
pid=
ctl status
expect_rc 1 "status (daemon gone)"
expect_err "deltactl: cannot reach deltad at unix:$sock: UNAVAILABLE"
ctl health
expect_rc 1 "health (daemon gone)"
echo "deltactl_test: passed"
