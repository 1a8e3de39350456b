#!/usr/bin/env bash
# The GPU pack's runner (scripts/gpu-pack-run) on a fake pack whose tests and
# benchmarks are stubs, so that it runs without a GPU: a lent GPU machine
# kills a command at its limit and sends back few files, so the runner must
# (1) keep its output folder to the four files it names, (2) bound every
# stage by what is left of its budget, killing one that hangs and skipping
# those that no longer fit, and still leave every log written so far, and
# (3) hand torch_bench the time left as its own budget, and (4) keep
# torch_bench's time from a Python test that hangs.
set -euo pipefail
runner="$(cd "$(dirname "$0")/../.." && pwd)/scripts/gpu-pack-run"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

make_pack() {
  local pack=$1
  mkdir -p "$pack/bin" "$pack/lib" "$pack/lib-python" "$pack/python" \
    "$pack/bench" "$pack/tests/python"
  cp "$runner" "$pack/run"
  for t in gpu_test client_cuda_device_test daemon_cuda_backend_test; do
    cat >"$pack/bin/$t" <<'STUB'
#!/usr/bin/env bash
# A test binary: hangs when its name is in HANG, else passes.
if [[ ",${HANG:-}," == *",$(basename "$0"),"* ]]; then
  echo "[ RUN      ] Stub.Hangs"
  exec sleep 1000
fi
echo "[  PASSED  ] 3 tests."
STUB
  done
  cat >"$pack/bin/gpu_bench" <<'STUB'
#!/usr/bin/env bash
out=${1#--update_doc=}
echo "## gpu_bench: stub (${DELTAD_BENCH_COMMAND})" >"$out"
echo "gpu_bench: measured"
STUB
  # The machine's Python: sees a GPU, passes the tests, and for torch_bench
  # records its arguments and writes its section.
  cat >"$pack/fakepython" <<'STUB'
#!/usr/bin/env bash
[[ $1 == -c ]] && exit 0
case "$(basename "$1")" in
  torch_bench.py)
    echo "$@" >"$ARGS_FILE"
    while [[ $# -gt 0 ]]; do
      [[ $1 == --update_doc ]] && echo "## torch_bench: stub" >"$2"
      shift
    done
    ;;
  *)
    # A Python test: hangs when its name is in HANG, else passes.
    [[ ",${HANG:-}," == *",$(basename "$1" .py),"* ]] && exec sleep 1000
    printf 'Ran 2 tests in 0.1s\n\nOK\n' >&2
    ;;
esac
STUB
  chmod +x "$pack"/bin/* "$pack/fakepython" "$pack/run"
}

# (1) and (3): every stage runs and passes.
make_pack "$tmp/pack"
export ARGS_FILE="$tmp/torch_bench_args"
DELTAD_PACK_PYTHON="$tmp/pack/fakepython" \
  bash "$tmp/pack/run" "$tmp/out" 480 >"$tmp/run1.txt" 2>&1 ||
  { cat "$tmp/run1.txt"; fail "a run whose stages all pass exited non-zero"; }
files=$(find "$tmp/out" -mindepth 1 -printf '%f\n' | sort | tr '\n' ' ')
[[ $files == "gpu_bench.md logs.tar.gz summary.txt torch_bench.md " ]] ||
  fail "the output folder holds '$files', not the four files the runner names"
grep -q "test_torch_correctness: passed" "$tmp/out/summary.txt" ||
  fail "the Python tests did not run: $(cat "$tmp/out/summary.txt")"
# 480 s less the 90 kept for gpu_bench, less a minute for its end: 330 when
# the stages before took no time.
budget=$(sed -E 's/.*--time_budget_s ([0-9]+).*/\1/' "$ARGS_FILE")
[[ $budget -ge 320 && $budget -le 330 ]] ||
  fail "torch_bench's own budget is '$budget', expected 320-330 s"
# (Listed whole first: `grep -q` stops reading at the match, and tar,
# killed by SIGPIPE, would fail the pipeline under pipefail.)
listing=$(tar -tzf "$tmp/out/logs.tar.gz")
[[ $listing == *logs/torch_bench.txt* ]] ||
  fail "torch_bench's log is not in logs.tar.gz"

# (2): a test that hangs is killed at what is left of a 25-s budget; the
# stages after it are skipped, saying so; the run ends within the budget
# (and the kill's grace) and fails; the logs so far come back.
rm -rf "$tmp/out"
SECONDS=0
if HANG=gpu_test DELTAD_PACK_PYTHON="$tmp/pack/fakepython" \
    bash "$tmp/pack/run" "$tmp/out" 25 >"$tmp/run2.txt" 2>&1; then
  fail "a run with a hanging test exited 0"
fi
took=$SECONDS
[[ $took -le 40 ]] || fail "a 25-s budget took ${took} s"
summary=$(cat "$tmp/out/summary.txt")
[[ $summary == *"gpu_test: FAILED (killed after 25 s"* ]] ||
  fail "the hanging test is not reported killed: $summary"
[[ $summary == *"torch_bench: skipped, "*" s left of the budget"* ]] ||
  fail "torch_bench is not reported skipped for want of time: $summary"
listing=$(tar -tzf "$tmp/out/logs.tar.gz")
[[ $listing == *logs/gpu_test.log* ]] ||
  fail "the killed test's log is not in logs.tar.gz"
tar -xzf "$tmp/out/logs.tar.gz" -C "$tmp" logs/gpu_test.log
grep -q "Stub.Hangs" "$tmp/logs/gpu_test.log" ||
  fail "the killed test's log lost what it printed"

# (4): a Python test that hangs is killed in time for torch_bench, which
# carries the PyTorch targets, to run: of a 290-s budget it gets 35 s, what
# is left above torch_bench's least 150 s, gpu_bench's 90 and a 15-s grace
# (less the seconds the stages before took: 1 on a loaded CI machine).
rm -rf "$tmp/out"
SECONDS=0
if HANG=test_torch_correctness DELTAD_PACK_PYTHON="$tmp/pack/fakepython" \
    bash "$tmp/pack/run" "$tmp/out" 290 >"$tmp/run3.txt" 2>&1; then
  fail "a run with a hanging Python test exited 0"
fi
summary=$(cat "$tmp/out/summary.txt")
[[ $summary =~ test_torch_correctness:\ FAILED\ \(killed\ after\ 3[3-5]\ s\) ]] ||
  fail "the hanging Python test is not killed after 33-35 s: $summary"
[[ $summary == *"torch_bench: done in "* ]] ||
  fail "torch_bench did not run after a hanging Python test: $summary"
[[ $SECONDS -le 60 ]] || fail "the 290-s budget's run took ${SECONDS} s"
echo "PASS: the runner keeps four files, bounds its stages and hands torch_bench the time left"
