#!/usr/bin/env bash
# The main job: JupyterLab on the quickstart notebook, or with --headless the notebook executed
# through a real kernel and its reports printed. Other arguments go to `jupyter lab`
# (e.g. --no-browser --port=8890).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "${1:-}" = "--headless" ]; then
  "${PIP[@]}" "nbclient>=0.10" "ipykernel>=6.25"
  exec "$VENV/bin/python" scripts/run_notebook.py notebooks/quickstart.ipynb
fi
ARGS=()
if [ "$(id -u)" = 0 ]; then
  # Containers and cloud notebooks run as root; JupyterLab refuses to start as root without it.
  echo "== running as root: passing --allow-root to JupyterLab"
  ARGS+=(--allow-root)
fi
# The quickstart as the default page: the browser JupyterLab opens and the URL it prints (the one to
# copy with --no-browser) both land on it.
exec "$VENV/bin/jupyter" lab --ServerApp.root_dir="$ROOT" \
  --LabApp.default_url=/lab/tree/notebooks/quickstart.ipynb "${ARGS[@]}" "$@"
