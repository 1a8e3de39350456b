#!/usr/bin/env bash
# The sidecar variant's lifecycle (deploy/kubernetes/sidecar-pod.yaml), here
# without Kubernetes: the two containers' shell scripts, the ConfigMap's
# deltad.conf and train.py, taken from the manifest as they are, run side
# by side with the pod's paths moved into a temporary directory, the real
# deltad (on simulated GPUs instead of "cuda") and a stand-in nvidia-smi.
# Training must reach the daemon ("daemon" in its step lines), and when it
# ends the deltad container must drain deltad and exit 0, as must train;
# then again with SIGTERM to both mid-training (a deleted pod): train exits
# 143, deltad drains and exits 0.
#
#   sidecar_lifecycle_test.sh NODE TOOLS_DIR DELTAD PYTHON3 CLIENT_LIBRARY REPO
set -euo pipefail
if [[ $# -ne 6 ]]; then
  echo "usage: $0 NODE TOOLS_DIR DELTAD PYTHON3 CLIENT_LIBRARY REPO" >&2
  exit 2
fi
node=$1 tools=$2 deltad=$3 python=$4 library=$5 repo=$6
manifest=$repo/deploy/kubernetes/sidecar-pod.yaml

if [[ ! -f $tools/node_modules/.package-lock.json ]]; then
  echo "sidecar_lifecycle_test: the Node.js tools are not installed in $tools:" \
       "run scripts/setup (or scripts/setup-node-tools)" >&2
  exit 1
fi
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "sidecar_lifecycle_test: $python cannot import torch: run scripts/setup" >&2
  exit 1
fi

tmp=$(mktemp -d /tmp/deltad-sidecar-XXXXXX)
# Each container in a process group of its own, so that cleanup ends its
# children (deltad, python3) too.
set -m
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# The manifest's pieces, with the pod's paths moved under $tmp.
"$node" --input-type=module -e '
import fs from "node:fs";
import { createRequire } from "node:module";
const [tools, manifest, tmp, deltad] = process.argv.slice(1);
const YAML = createRequire(`${tools}/package.json`)("yaml");
const docs = YAML.parseAllDocuments(fs.readFileSync(manifest, "utf8"),
                                    { version: "1.1" })
  .map((d) => d.toJS()).filter((d) => d);
const map = docs.find((d) => d.kind === "ConfigMap");
const pod = docs.find((d) => d.kind === "Pod");
const move = (s) => s.replaceAll("/run/deltad", `${tmp}/run`)
  .replaceAll("/etc/deltad/deltad.conf", `${tmp}/deltad.conf`)
  .replaceAll("/opt/train/train.py", `${tmp}/train.py`)
  .replaceAll("/usr/sbin/deltad", deltad);
const script = (name) => {
  const c = pod.spec.containers.find((x) => x.name === name);
  if (c?.command?.join(" ") !== "/bin/sh -c") {
    throw new Error(`container ${name} is not a /bin/sh -c script`);
  }
  return move(c.args[0]);
};
fs.writeFileSync(`${tmp}/train.sh`, script("train"));
fs.writeFileSync(`${tmp}/deltad.sh`, script("deltad"));
fs.writeFileSync(`${tmp}/train.py`, map.data["train.py"]);
// Simulated GPUs: the same configuration on a machine without one.
const conf = move(map.data["deltad.conf"]);
if (!/^backend: "cuda"$/m.test(conf)) throw new Error("backend is not cuda");
fs.writeFileSync(`${tmp}/deltad.conf`, conf.replace(/^backend: "cuda"$/m,
  "backend: \"sim\"\nsim { gpus: 1 memory_bytes: 4294967296 }"));
' "$tools" "$manifest" "$tmp" "$deltad"

mkdir -p "$tmp/bin"
cat >"$tmp/bin/nvidia-smi" <<'EOF'
#!/bin/sh
echo GPU-00000000-1111-2222-3333-444444444444
EOF
printf '#!/bin/sh\nexec %q "$@"\n' "$python" >"$tmp/bin/python3"
chmod +x "$tmp/bin/nvidia-smi" "$tmp/bin/python3"
# Loopback on a free port: the manifest's 127.0.0.1:9464 may be taken here.
sed -i 's/^metrics_address: .*/metrics_address: "127.0.0.1:0"/' "$tmp/deltad.conf"

export PATH="$tmp/bin:$PATH"
export PYTHONPATH="$repo/client/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export DELTAD_CLIENT_LIBRARY="$library"
export DELTAD_SOCKET="$tmp/run/deltad.sock"

fail() {
  echo "sidecar_lifecycle_test: $*" >&2
  for f in train deltad; do
    echo "--- $f container:" >&2
    cat "$tmp/$f.log" >&2 || true
  done
  exit 1
}

# Waits for pid $1 at most $2 seconds; sets status to its exit status, or
# to "timeout".
wait_for() {
  local pid=$1 left=$2
  while kill -0 "$pid" 2>/dev/null && ((left-- > 0)); do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    status=timeout
    return
  fi
  status=0
  wait "$pid" || status=$?
}

pod() {  # starts both containers, as the kubelet would, in $tmp/run
  rm -rf "$tmp/run"
  mkdir -p "$tmp/run"
  sh "$tmp/deltad.sh" >"$tmp/deltad.log" 2>&1 &
  deltad_pid=$!
  sh "$tmp/train.sh" >"$tmp/train.log" 2>&1 &
  train_pid=$!
  pids=("$deltad_pid" "$train_pid")
}

echo "== training runs to its end"
export STEPS=3
pod
wait_for "$train_pid" 180
train_status=$status
wait_for "$deltad_pid" 40
deltad_status=$status
[[ $train_status == 0 ]] || fail "train exited $train_status, not 0"
[[ $deltad_status == 0 ]] || fail "the deltad container exited $deltad_status, not 0"
grep -q "^step 2: .*, daemon$" "$tmp/train.log" ||
  fail "training did not reach the daemon"
grep -q "draining" "$tmp/deltad.log" || fail "deltad was not drained"
[[ $(cat "$tmp/run/trainer-done") == 0 ]] || fail "trainer-done does not say 0"
cat "$tmp/train.log"
tail -n 2 "$tmp/deltad.log"

echo "== SIGTERM to both containers mid-training (the pod is deleted)"
export STEPS=1000
pod
for _ in $(seq 120); do
  grep -q "^step 0: .*, daemon$" "$tmp/train.log" 2>/dev/null && break
  sleep 1
done
grep -q "^step 0: .*, daemon$" "$tmp/train.log" ||
  fail "training did not reach the daemon"
kill -TERM "$train_pid" "$deltad_pid"
wait_for "$train_pid" 30
train_status=$status
wait_for "$deltad_pid" 30
deltad_status=$status
[[ $train_status == 143 ]] || fail "train exited $train_status, not 143"
[[ $deltad_status == 0 ]] || fail "the deltad container exited $deltad_status, not 0"
grep -q "draining" "$tmp/deltad.log" || fail "deltad was not drained"
tail -n 2 "$tmp/deltad.log"
echo "sidecar_lifecycle_test: passed"
