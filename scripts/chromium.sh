#!/usr/bin/env bash
# Debian's Chromium for the browser tests (ui-tests/run.sh, install_check.sh), installed with apt-get
# when there is none (as root, or through sudo).
set -euo pipefail
if [ -x "${CHROMIUM:-/usr/bin/chromium}" ]; then
  exit 0
fi
echo "installing Debian's chromium"
SUDO=()
[ "$(id -u)" = 0 ] || SUDO=(sudo)
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq chromium >/dev/null
