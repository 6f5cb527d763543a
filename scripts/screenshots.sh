#!/usr/bin/env bash
# The README's pictures from the product: runs notebooks/quickstart.ipynb in the real JupyterLab in
# Debian's Chromium (as ui-tests/run.sh does) and writes docs/quickstart-oom.png (the report after the
# training cell ran out of memory) and docs/quickstart-fitted.png (after its first fix, the sidebar
# open). Needs the virtualenv of scripts/setup.sh and a Chromium (scripts/chromium.sh installs one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OOMMAGIC_VENV="${OOMMAGIC_VENV:-$ROOT/.venv}"
export CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
export PATH="$OOMMAGIC_VENV/bin:$PATH"
OOMMAGIC_UI_PORT="${OOMMAGIC_UI_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export OOMMAGIC_UI_PORT
cd "$ROOT/ui-tests"
jlpm install --immutable
jlpm playwright test -c playwright.screenshots.config.ts "$@"
ls -l "$ROOT"/docs/quickstart-*.png
