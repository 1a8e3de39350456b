#!/usr/bin/env bash
# install_test: `cmake --install` of the build into a staging root (DESTDIR,
# the configured prefix under it), then
#   1. every file is where the install section promises, the daemon's and
#      the tools' binaries run, and the library is the SDK (its SONAME, only
#      deltad_* exported);
#   2. the unit starts the staged daemon with the staged configuration, and
#      that configuration parses: all defaults but the backend;
#   3. the dashboards in dashboards/ are all installed;
#   4. consumer/ (what a trainer's build does: find_package(deltad),
#      deltad::client) configures, builds without warnings in C and C++,
#      and runs one track/pin/free against the staged library; a version
#      the package does not satisfy is refused.
# The paths come from CMake (tests/deploy/systemd/CMakeLists.txt).
set -euo pipefail

for v in CMAKE_COMMAND DELTAD_SOURCE_DIR DELTAD_BUILD_DIR DELTAD_GENERATOR \
         DELTAD_VERSION DELTAD_SOVERSION DELTAD_PREFIX DELTAD_SBINDIR \
         DELTAD_BINDIR DELTAD_LIBDIR DELTAD_INCLUDEDIR DELTAD_DATADIR \
         DELTAD_CONFDIR DELTAD_UNITDIR DELTAD_SYSUSERSDIR DELTAD_CMAKEDIR \
         DELTAD_DEFAULT_BACKEND; do
  [[ -n "${!v:-}" ]] || { echo "install_test: $v is not set" >&2; exit 2; }
done

fail() {
  echo "install_test: FAIL: $*" >&2
  exit 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/deltad-install-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root

echo "== cmake --install $DELTAD_BUILD_DIR (DESTDIR=$root, prefix $DELTAD_PREFIX)"
DESTDIR=$root "$CMAKE_COMMAND" --install "$DELTAD_BUILD_DIR" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "cmake --install failed"; }
(cd "$root" && find . \( -type f -o -type l \) | sort | sed 's|^\.|  |')

# 1. The files, each where it was promised.
expect_file() {
  [[ -f "$root$1" ]] || fail "missing $1"
}
expect_exec() {
  [[ -f "$root$1" && -x "$root$1" ]] || fail "missing or not executable: $1"
}
deltad=$root$DELTAD_SBINDIR/deltad
expect_exec "$DELTAD_SBINDIR/deltad"
expect_exec "$DELTAD_BINDIR/deltactl"
expect_file "$DELTAD_INCLUDEDIR/deltad/deltad_client.h"
expect_file "$DELTAD_LIBDIR/libdeltad_client.so.$DELTAD_VERSION"
for link in libdeltad_client.so "libdeltad_client.so.$DELTAD_SOVERSION"; do
  [[ -L "$root$DELTAD_LIBDIR/$link" && -f "$root$DELTAD_LIBDIR/$link" ]] ||
    fail "$DELTAD_LIBDIR/$link is not a link to the library"
done
for f in deltadConfig.cmake deltadConfigVersion.cmake deltadTargets.cmake; do
  expect_file "$DELTAD_CMAKEDIR/$f"
done
expect_file "$DELTAD_UNITDIR/deltad.service"
expect_file "$DELTAD_SYSUSERSDIR/deltad.conf"
expect_file "$DELTAD_CONFDIR/deltad.conf"
# The C++ API is not part of the SDK: nothing of client/, policies/ or the
# generated protobuf headers is installed.
extra=$(cd "$root$DELTAD_INCLUDEDIR" && find . -type f ! -path ./deltad/deltad_client.h)
[[ -z "$extra" ]] || fail "headers beyond the C API installed: $extra"

for b in "$deltad" "$root$DELTAD_BINDIR/deltactl"; do
  ldd "$b" | grep -q "not found" && fail "$b: $(ldd "$b" | grep 'not found')"
done

lib=$root$DELTAD_LIBDIR/libdeltad_client.so
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ "$soname" == "libdeltad_client.so.$DELTAD_SOVERSION" ]] ||
  fail "SONAME of $lib is '$soname', expected libdeltad_client.so.$DELTAD_SOVERSION"
others=$(nm -D --defined-only "$lib" | awk '{ print $NF }' | grep -v '^deltad_' || true)
[[ -z "$others" ]] || fail "libdeltad_client.so exports more than deltad_*: $others"
nm -D --defined-only "$lib" | grep -q ' deltad_client_connect$' ||
  fail "libdeltad_client.so does not export deltad_client_connect"
echo "ok: files in place; SONAME $soname; only deltad_* exported"

# 2. The unit runs the staged daemon with the staged configuration.
unit=$root$DELTAD_UNITDIR/deltad.service
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
[[ "$exec_start" == "$DELTAD_SBINDIR/deltad --config=$DELTAD_CONFDIR/deltad.conf" ]] ||
  fail "ExecStart is '$exec_start'"
grep -q '@[A-Za-z_]*@' "$unit" && fail "unsubstituted @VAR@ in $unit"
grep -q '@[A-Za-z_]*@' "$root$DELTAD_CONFDIR/deltad.conf" &&
  fail "unsubstituted @VAR@ in deltad.conf"
# The default configuration: deltad's own defaults but the backend.
: >"$tmp/empty.conf"
"$deltad" --config="$tmp/empty.conf" --print_config >"$tmp/defaults.txt" ||
  fail "deltad --print_config with an empty configuration failed"
"$deltad" --config="$root$DELTAD_CONFDIR/deltad.conf" --print_config \
  >"$tmp/installed.txt" 2>"$tmp/installed.err" ||
  fail "the installed deltad.conf does not load: $(cat "$tmp/installed.err")"
grep -qx "backend: \"$DELTAD_DEFAULT_BACKEND\"" "$tmp/installed.txt" ||
  fail "the installed deltad.conf does not say backend: \"$DELTAD_DEFAULT_BACKEND\""
diff <(grep -v '^backend:' "$tmp/defaults.txt") \
     <(grep -v '^backend:' "$tmp/installed.txt") >"$tmp/config.diff" ||
  fail "the installed deltad.conf sets more than the backend:
$(cat "$tmp/config.diff")"
# The lines "#field: value" (notes are "# ..."), uncommented, are every
# field at deltad's default: the file shows all of them, and no stale ones.
# ("#name {" opens a message whose lines are "#  field: value" up to "#}".)
awk '/^#[a-z_0-9]+ \{/ { block = 1; print; next }
     block { print; if ($0 ~ /^#\}/) block = 0; next }
     /^#[^ #]/ { print }' "$root$DELTAD_CONFDIR/deltad.conf" |
  sed -E 's/^#//; s/ +#.*$//' >"$tmp/uncommented.conf"
for field in $(sed -nE 's/^ *([a-z_0-9]+)(:| \{).*/\1/p' "$tmp/defaults.txt" | grep -vx backend); do
  grep -qE "^ *$field(:| \{)" "$tmp/uncommented.conf" ||
    fail "deltad.conf does not show the field $field"
done
"$deltad" --config="$tmp/uncommented.conf" --print_config >"$tmp/uncommented.txt" \
  2>"$tmp/uncommented.err" ||
  fail "deltad.conf's commented-out defaults do not parse: $(cat "$tmp/uncommented.err")"
diff "$tmp/defaults.txt" "$tmp/uncommented.txt" >"$tmp/defaults.diff" ||
  fail "deltad.conf's commented-out values are not deltad's defaults:
$(cat "$tmp/defaults.diff")"
echo "ok: ExecStart=$exec_start; deltad.conf: defaults, backend \"$DELTAD_DEFAULT_BACKEND\""

# 3. Dashboards and their provisioning files, as many as there are.
dashboards=0
if [[ -d "$DELTAD_SOURCE_DIR/dashboards" ]]; then
  while IFS= read -r -d '' f; do
    rel=${f#"$DELTAD_SOURCE_DIR/dashboards/"}
    expect_file "$DELTAD_DATADIR/deltad/dashboards/$rel"
    dashboards=$((dashboards + 1))
  done < <(find "$DELTAD_SOURCE_DIR/dashboards" -type f \
             \( -name '*.json' -o -name '*.yaml' -o -name '*.yml' -o -name '*.md' \) -print0)
fi
echo "ok: $dashboards dashboard files under $DELTAD_DATADIR/deltad/dashboards"

# 4. A trainer's build against the staged SDK.
consumer_src=$DELTAD_SOURCE_DIR/tests/deploy/systemd/consumer
echo "== consumer: find_package(deltad) with CMAKE_PREFIX_PATH=$root$DELTAD_PREFIX"
"$CMAKE_COMMAND" -S "$consumer_src" -B "$tmp/consumer" -G "$DELTAD_GENERATOR" \
  -DCMAKE_PREFIX_PATH="$root$DELTAD_PREFIX" -DCMAKE_BUILD_TYPE=Release \
  -DDELTAD_EXPECT_VERSION="$DELTAD_VERSION" >"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log" >&2; fail "the consumer does not configure"; }
"$CMAKE_COMMAND" --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log" >&2; fail "the consumer does not build"; }
# No LD_LIBRARY_PATH: the imported target's location gives the build RPATH.
resolved=$(ldd "$tmp/consumer/consumer" | awk '/libdeltad_client/ { print $3 }')
[[ "$(readlink -f "$resolved")" == "$(readlink -f "$root$DELTAD_LIBDIR")"/* ]] ||
  fail "the consumer loads libdeltad_client from '$resolved', not the staged one"
"$tmp/consumer/consumer" || fail "the consumer failed"
"$tmp/consumer/consumer_cxx" || fail "the C++ consumer failed"
# The next minor version is refused (SameMinorVersion: while deltad is 0.x
# a minor release may change the C API's structs).
IFS=. read -r major minor _ <<<"$DELTAD_VERSION"
newer=$major.$((minor + 1))
if "$CMAKE_COMMAND" -S "$consumer_src" -B "$tmp/consumer-newer" \
     -G "$DELTAD_GENERATOR" -DCMAKE_PREFIX_PATH="$root$DELTAD_PREFIX" \
     -DDELTAD_REQUIRE_VERSION="$newer" >"$tmp/newer.log" 2>&1; then
  fail "find_package(deltad $newer) was satisfied by $DELTAD_VERSION"
fi
grep -q "requested version \"$newer\"" "$tmp/newer.log" ||
  { cat "$tmp/newer.log" >&2; fail "find_package(deltad $newer) failed for another reason"; }
echo "ok: consumer built with deltad::client $DELTAD_VERSION and ran"
echo "install_test: passed"
