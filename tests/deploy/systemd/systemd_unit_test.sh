#!/usr/bin/env bash
# systemd_unit_test: the installed deltad.service, checked by systemd's own
# tools without a running systemd. The daemon component is installed into a
# staging root (DESTDIR) with the host's systemd units beside it, so that
# `systemd-analyze --root=<stage>` resolves the unit's dependencies
# (sysinit.target, ...) and its ExecStart= binary inside the stage:
#   1. `systemd-analyze verify` prints nothing about the unit and exits 0;
#      the same unit with ExecStart= pointing at a missing binary fails (so
#      the check does look inside the stage);
#   2. `systemd-analyze security --offline` rates it at most 3.0 (2.1 with
#      systemd 252);
#   3. what the unit promises the daemon: Type=notify with a watchdog, the
#      user deltad, /run/deltad holding the daemon's default socket;
#   4. `systemd-sysusers --root` makes the user and group deltad from the
#      installed sysusers.d file.
set -euo pipefail

for v in CMAKE_COMMAND DELTAD_BUILD_DIR DELTAD_SBINDIR DELTAD_CONFDIR \
         DELTAD_UNITDIR DELTAD_SYSUSERSDIR SYSTEMD_ANALYZE SYSTEMD_SYSUSERS; do
  [[ -n "${!v:-}" ]] || { echo "systemd_unit_test: $v is not set" >&2; exit 2; }
done
fail() {
  echo "systemd_unit_test: FAIL: $*" >&2
  exit 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/deltad-unit-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root

DESTDIR=$root "$CMAKE_COMMAND" --install "$DELTAD_BUILD_DIR" --component daemon \
  >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log" >&2; fail "cmake --install failed"; }
unit_path=$DELTAD_UNITDIR/deltad.service
[[ -f "$root$unit_path" ]] || fail "no $unit_path in the staged install"
# The host's units (sysinit.target and the like), without replacing ours
# where the prefix is /usr.
host_units=
for d in /usr/lib/systemd/system /lib/systemd/system; do
  [[ -f "$d/sysinit.target" ]] && { host_units=$d; break; }
done
[[ -n "$host_units" ]] || fail "no systemd units on this host (sysinit.target)"
mkdir -p "$root/usr/lib/systemd/system"
cp -rn "$host_units/." "$root/usr/lib/systemd/system/"

# 1. verify: no word about our unit. --recursive-errors=no: the exit
# status reflects warnings about this unit only; --man=no: no man(1) call.
analyze=("$SYSTEMD_ANALYZE" --no-pager)
verify() {
  "${analyze[@]}" verify --recursive-errors=no --man=no --root="$root" "$1" 2>&1
}
echo "== systemd-analyze verify --root=<stage> $unit_path"
if ! out=$(verify "$unit_path"); then
  echo "$out" >&2
  fail "systemd-analyze verify failed"
fi
if grep -F 'deltad.service' <<<"$out" >&2; then
  fail "systemd-analyze verify has warnings for deltad.service (above)"
fi
[[ -z "$out" ]] && echo "ok: verify printed nothing" ||
  { echo "verify printed (not about deltad):"; echo "$out"; }
# The same unit with a binary that is not in the stage must fail: the check
# above did resolve ExecStart= inside it.
broken=${unit_path%/*}/deltad-broken.service
sed 's|^ExecStart=[^ ]*|ExecStart=/nonexistent/deltad|' "$root$unit_path" >"$root$broken"
if out=$(verify "$broken"); then
  fail "verify accepted a unit whose ExecStart= binary is missing: $out"
fi
grep -q '/nonexistent/deltad' <<<"$out" || fail "unexpected verify output: $out"
rm "$root$broken"
echo "ok: a missing ExecStart= binary is caught"

# 2. The sandbox, as systemd rates it (0 safest, 10 least safe).
if ! out=$("${analyze[@]}" security --offline=yes --threshold=30 --root="$root" \
             "$unit_path" 2>&1); then
  echo "$out" >&2
  fail "systemd-analyze security rates deltad.service above 3.0"
fi
grep -m1 'Overall exposure level' <<<"$out" || true

# 3. What the unit and the daemon agree on.
unit=$root$unit_path
expect() {
  grep -qx "$1" "$unit" || fail "deltad.service lacks '$1'"
}
expect 'Type=notify'
expect 'WatchdogSec=30s'
expect 'Restart=on-failure'
expect 'User=deltad'
expect 'Group=deltad'
expect 'RuntimeDirectory=deltad'
expect 'RuntimeDirectoryMode=0750'
expect 'LimitMEMLOCK=infinity'
expect 'DevicePolicy=closed'
expect 'DeviceAllow=char-nvidia\* rw'
grep -qE '^(PrivateDevices|MemoryDenyWriteExecute|DynamicUser|PrivateUsers)=(yes|true)' "$unit" &&
  fail "deltad.service sets an option that breaks CUDA or the socket's group"
nofile=$(sed -n 's/^LimitNOFILE=//p' "$unit")
[[ "$nofile" =~ ^[0-9]+$ && "$nofile" -ge 65536 ]] || fail "LimitNOFILE=$nofile is not high"
# The daemon's default socket lies in RuntimeDirectory= (the installed
# configuration leaves socket_path at its default).
socket=$("$root$DELTAD_SBINDIR/deltad" --config="$root$DELTAD_CONFDIR/deltad.conf" \
           --print_config | sed -n 's/^socket_path: "\(.*\)"$/\1/p')
[[ "$socket" == /run/deltad/* ]] ||
  fail "the daemon's socket $socket is not under /run/deltad (RuntimeDirectory=deltad)"
echo "ok: notify + watchdog, user deltad, socket $socket in RuntimeDirectory"

# 4. The user and group, made in an empty root.
mkdir -p "$tmp/sysroot/etc"
"$SYSTEMD_SYSUSERS" --root="$tmp/sysroot" "$root$DELTAD_SYSUSERSDIR/deltad.conf" \
  >"$tmp/sysusers.log" 2>&1 || { cat "$tmp/sysusers.log" >&2; fail "systemd-sysusers failed"; }
grep -qE '^deltad:x:[0-9]+:[0-9]+:[^:]*:[^:]*:.*nologin$' "$tmp/sysroot/etc/passwd" ||
  fail "no system user deltad (nologin): $(cat "$tmp/sysroot/etc/passwd")"
grep -qE '^deltad:x:[0-9]+:' "$tmp/sysroot/etc/group" ||
  fail "no group deltad: $(cat "$tmp/sysroot/etc/group")"
echo "ok: systemd-sysusers makes user and group deltad"
echo "systemd_unit_test: passed"
