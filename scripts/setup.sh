#!/usr/bin/env bash
# Prepare .venv for oommagic: Python packages, the lab extension built and installed.
# Sourced by lab.sh and test.sh. A torch the user already has is kept (the venv sees the system's
# site-packages); without one, TORCH_SPEC (default torch==2.13.0) is installed. The editable install
# (and with it the extension's build) is skipped when nothing it is made from changed since the last
# one; OOMMAGIC_REINSTALL=1 forces it.
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
# No bytecode written at install: each module is compiled when first imported, and most never are
# (torch, transformers and JupyterLab installed in 38 s instead of 74 s on 2 cores).
PIP=("$VENV/bin/python" -m pip install -q --no-compile)

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "== using the installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
else
  echo "== installing ${TORCH_SPEC:=torch==2.13.0}"
  "${PIP[@]}" "$TORCH_SPEC"
fi

# What the editable install is made from: Python code is live in an editable install, the extension
# and the dependencies are not.
sources_hash() {
  find pyproject.toml jupyter-config labextension/package.json labextension/yarn.lock \
    labextension/install.json labextension/tsconfig.json labextension/src labextension/style \
    -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}
STAMP_FILE="$VENV/.oommagic-install"
STAMP="$(sources_hash) ${OOMMAGIC_EXTRAS:-}"
# Installed from the same sources with the same extras; a plain install is satisfied by any extras.
read -r INSTALLED_HASH INSTALLED_EXTRAS 2>/dev/null <"$STAMP_FILE" || true
if [ -z "${OOMMAGIC_REINSTALL:-}" ] && [ "${INSTALLED_HASH:-}" = "${STAMP%% *}" ] &&
  { [ -z "${OOMMAGIC_EXTRAS:-}" ] || [ "${INSTALLED_EXTRAS:-}" = "$OOMMAGIC_EXTRAS" ]; } &&
  "$VENV/bin/python" -c "import oommagic" 2>/dev/null; then
  echo "== oommagic${INSTALLED_EXTRAS:-} is installed from these sources (OOMMAGIC_REINSTALL=1 installs it again)"
else
  # Build requirements are installed into the venv so the editable install needs no isolated build env.
  "${PIP[@]}" "hatchling>=1.21" "hatch-jupyter-builder>=0.9" "hatch-nodejs-version>=0.3.2" "editables" \
    "jupyterlab>=4.1,<5"
  # The builder runs `jlpm` (JupyterLab's yarn) from PATH.
  export PATH="$VENV/bin:$PATH"
  if ! command -v node >/dev/null; then
    echo "Node.js is needed to build the lab extension from source (apt-get install nodejs)" >&2
    exit 1
  fi
  echo "== installing oommagic${OOMMAGIC_EXTRAS:-} (builds the lab extension)"
  "${PIP[@]}" --no-build-isolation -e ".${OOMMAGIC_EXTRAS:-}"
  echo "$STAMP" >"$STAMP_FILE"
fi

# A package the system already has (IPython here) is not installed again into a venv made with
# --system-site-packages, and neither is its command: put the commands the README names into the venv,
# from the same version.
for command in ipython:ipython jupyter:jupyter_core jupyter-lab:jupyterlab; do
  if [ ! -x "$VENV/bin/${command%%:*}" ]; then
    dist="${command#*:}"
    version="$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$dist'))")"
    echo "== adding the ${command%%:*} command to $VENV ($dist $version)"
    "${PIP[@]}" --ignore-installed --no-deps "$dist==$version"
  fi
done
