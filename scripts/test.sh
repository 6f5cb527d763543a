#!/usr/bin/env bash
# Every test on a fresh machine: Python (real IPython, real kernels, a real Jupyter server), the lab
# extension's unit tests, and the browser tests in Debian's headless Chromium.
set -euo pipefail
OOMMAGIC_EXTRAS="[test]" source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export PATH="$VENV/bin:$PATH"

echo "== ruff"
ruff check oommagic tests benchmarks scripts
ruff format --check oommagic tests benchmarks scripts

echo "== lab extension unit tests"
(cd labextension && jlpm test)

echo "== python tests"
python -m pytest -q -p no:cacheprovider "$@"

echo "== browser tests"
if [ -z "${OOMMAGIC_SKIP_UI:-}" ]; then
  if ! command -v chromium >/dev/null; then
    echo "installing Debian's chromium"
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi
  fi
  bash ui-tests/run.sh
fi
