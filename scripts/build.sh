#!/usr/bin/env bash
# The release build: an sdist and a wheel in dist/, made by `python -m build` in a clean clone of HEAD
# (what is committed, nothing a development build left behind), with the production build of the lab
# extension; then checked by twine, check-wheel-contents and scripts/check_wheel.py.
#
# Needs Node.js (the sdist step builds the extension; the wheel is made from the sdist, which carries
# that build). Source maps only when asked: OOMMAGIC_SOURCE_MAPS=1. Tools go into $OOMMAGIC_TOOLS_VENV
# (default /tmp/oommagic-tools); the distributions into $OOMMAGIC_DIST (default dist/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIST="${OOMMAGIC_DIST:-$ROOT/dist}"
TOOLS="${OOMMAGIC_TOOLS_VENV:-/tmp/oommagic-tools}"
PY="${PYTHON:-python3}"
source "$ROOT/scripts/stages.sh"

if ! command -v node >/dev/null; then
  echo "build.sh: Node.js is needed to build the lab extension (apt-get install nodejs)" >&2
  exit 1
fi
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
  echo "build.sh: note: uncommitted changes are not in the build (it is made from HEAD)" >&2
fi
stage "build: tools"
if [ ! -x "$TOOLS/bin/python" ]; then
  "$PY" -m venv "$TOOLS"
fi
"$TOOLS/bin/python" -m pip install -q build twine check-wheel-contents

# The clone holds only what git has: logs, the build's output and tools live beside it, not in the sdist.
WORK="$(mktemp -d /tmp/oommagic-release-XXXXXX)"
trap 'stage_times build.sh; rm -rf "$WORK"' EXIT
CLONE="$WORK/oommagic"
git clone -q "$ROOT" "$CLONE"
stage "build: python -m build"
echo "HEAD $(git -C "$CLONE" rev-parse --short HEAD)"
if [ -n "${OOMMAGIC_SOURCE_MAPS:-}" ]; then
  # The hook's build:prod has no maps; build with them here and let the hook keep that build.
  "$PY" -m venv "$WORK/buildenv"
  "$WORK/buildenv/bin/pip" install -q "jupyterlab>=4.1,<5"
  (cd "$CLONE/labextension" && export PATH="$WORK/buildenv/bin:$PATH" && jlpm install --immutable &&
    jlpm run build:prod:maps)
  export SKIP_JUPYTER_BUILDER=1
fi
"$TOOLS/bin/python" -m build --outdir "$WORK/dist" "$CLONE" >"$WORK/build.log" 2>&1 || {
  tail -40 "$WORK/build.log" >&2
  echo "build.sh: python -m build failed (log above)" >&2
  exit 1
}

mkdir -p "$DIST"
VERSION="$(cd "$CLONE/labextension" && node -p 'require("./package.json").version')"
rm -f "$DIST/oommagic-$VERSION.tar.gz" "$DIST/oommagic-$VERSION-"*.whl
cp "$WORK"/dist/* "$DIST/"
WHEEL="$(ls "$DIST/oommagic-$VERSION-"*.whl)"

stage "build: checks"
echo "== twine check"
"$TOOLS/bin/twine" check --strict "$WHEEL" "$DIST/oommagic-$VERSION.tar.gz"
echo "== check-wheel-contents"
"$TOOLS/bin/check-wheel-contents" "$WHEEL"
echo "== wheel contents"
MAPS=()
[ -n "${OOMMAGIC_SOURCE_MAPS:-}" ] && MAPS=(--source-maps)
"$TOOLS/bin/python" "$ROOT/scripts/check_wheel.py" "$WHEEL" --build-dir "$WORK" "${MAPS[@]}"
echo "== sdist: what git has, the extension's production build and PKG-INFO, nothing else"
EXTRA="$(comm -13 <(git -C "$CLONE" ls-files | sort) \
  <(tar tzf "$DIST/oommagic-$VERSION.tar.gz" | grep -v '/$' | sed "s|^oommagic-$VERSION/||" | sort) |
  grep -Ev '^(PKG-INFO|oommagic/labextension/.*)$' || true)"
if [ -n "$EXTRA" ]; then
  echo "build.sh: files in the sdist that git does not have: $EXTRA" >&2
  exit 1
fi
echo "$WHEEL"
