#!/usr/bin/env bash
# The main job: JupyterLab with the quickstart notebook, or with --headless the notebook executed
# through a real kernel and its reports printed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "${1:-}" = "--headless" ]; then
  "${PIP[@]}" "nbclient>=0.10" "ipykernel>=6.25"
  exec "$VENV/bin/python" scripts/run_notebook.py notebooks/quickstart.ipynb
fi
exec "$VENV/bin/jupyter" lab notebooks/quickstart.ipynb "$@"
