#!/usr/bin/env bash
# Browser tests of the lab extension (what .ci/run calls through scripts/test.sh).
#
# Needs the project's virtualenv with oommagic installed and its lab extension built
# (scripts/setup.sh does both). Installs the npm packages from the committed yarn.lock, then
# Playwright starts JupyterLab itself (playwright.config.ts) and drives Debian's Chromium
# (/usr/bin/chromium, or $CHROMIUM); no browser is downloaded. Extra arguments go to
# `playwright test` (e.g. `bash ui-tests/run.sh -g devices`).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OOMMAGIC_VENV="${OOMMAGIC_VENV:-$HERE/../.venv}"
export CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
export PATH="$OOMMAGIC_VENV/bin:$PATH"
# A free port unless one is given: a server of another run on the machine may hold the default 8888.
OOMMAGIC_UI_PORT="${OOMMAGIC_UI_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export OOMMAGIC_UI_PORT
cd "$HERE"

if [ ! -x "$CHROMIUM" ]; then
  echo "ui-tests: no Chromium at $CHROMIUM (apt-get install chromium, or set CHROMIUM=/path/to/chromium)" >&2
  exit 1
fi
if ! jupyter labextension list 2>&1 | grep -q "oommagic.*enabled.*OK"; then
  echo "ui-tests: the oommagic lab extension is not installed in $OOMMAGIC_VENV;" \
    "run scripts/setup.sh (or: cd labextension && jlpm install && jlpm build:prod && cd .. &&" \
    "pip install -e . --no-build-isolation)" >&2
  exit 1
fi

jlpm install --immutable
jlpm test "$@"
