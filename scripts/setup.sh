#!/usr/bin/env bash
# Prepare .venv for oommagic: Python packages, the lab extension built and installed.
# Sourced by lab.sh and test.sh. A torch the user already has is kept (the venv sees the system's
# site-packages); without one, TORCH_SPEC (default torch==2.13.0) is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OOMMAGIC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
cd "$ROOT"

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PY" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q)

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "== using the installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
else
  echo "== installing ${TORCH_SPEC:=torch==2.13.0}"
  "${PIP[@]}" "$TORCH_SPEC"
fi

# Build requirements are installed into the venv so the editable install needs no isolated build env.
"${PIP[@]}" "hatchling>=1.21" "hatch-jupyter-builder>=0.9" "editables" "jupyterlab>=4.1,<5"
# The builder runs `jlpm` (JupyterLab's yarn) from PATH.
export PATH="$VENV/bin:$PATH"
if ! command -v node >/dev/null; then
  echo "Node.js is needed to build the lab extension from source (apt-get install nodejs)" >&2
  exit 1
fi
echo "== installing oommagic${OOMMAGIC_EXTRAS:-} (builds the lab extension)"
"${PIP[@]}" --no-build-isolation -e ".${OOMMAGIC_EXTRAS:-}"
