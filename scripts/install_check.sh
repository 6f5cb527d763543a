#!/usr/bin/env bash
# The README's install stories, tried on a built wheel (default: the newest dist/oommagic-*.whl, made by
# scripts/build.sh) in fresh virtualenvs whose PATH is only their own bin/ (no Node.js):
#   term      pip install oommagic            -> `ipython` is there and `%load_ext oommagic` reports a cell
#   lab       pip install "oommagic[lab]"     -> the extension is listed "enabled OK (python, oommagic)",
#                                                the server extension too; JupyterLab shows the panel
#   notebook  pip install notebook, then pip install oommagic  -> the same in Notebook 7
# The browser half is ui-tests/install/ in Debian's Chromium. torch is installed once into a shared
# directory that each virtualenv sees (as a machine's own torch would be), not once per virtualenv.
# pip resolves every story's packages from the indexes once (`pip download` into a wheelhouse); each
# story's `pip install` then installs from that wheelhouse, offline, so no wheel is fetched twice.
# Work goes to $OOMMAGIC_INSTALL_DIR (default: a new /tmp/oommagic-install-* directory).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/stages.sh"
PY="${PYTHON:-python3}"
WHEEL="${1:-$(ls -t "$ROOT"/dist/oommagic-*.whl 2>/dev/null | head -1)}"
if [ ! -f "$WHEEL" ]; then
  echo "install_check.sh: no wheel (build one with: bash scripts/build.sh)" >&2
  exit 1
fi
WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
if [ -n "${OOMMAGIC_INSTALL_DIR:-}" ]; then
  WORK="$OOMMAGIC_INSTALL_DIR"
  trap 'stage_times install_check.sh' EXIT
else
  # Our own directory: gone once every story passed, kept to look into when one failed. Removed in the
  # background (a few GB of small files, up to a minute on a busy disk), holding none of our output.
  WORK="$(mktemp -d /tmp/oommagic-install-XXXXXX)"
  trap 'status=$?; stage_times install_check.sh
    if [ $status = 0 ]; then rm -rf "$WORK" </dev/null >/dev/null 2>&1 & fi' EXIT
fi
echo "== install stories for $(basename "$WHEEL") in $WORK"

stage "install: pip download, once"
WHEELS="$WORK/wheels"
"$PY" -m pip download -q -d "$WHEELS" "${TORCH_SPEC:=torch==2.13.0}" "$WHEEL[lab]" "notebook>=7,<8"
# The stories' pip: the wheelhouse only, and no bytecode written at install (each module is compiled
# when first imported, as Python does for any module without it): it took half of an install's time.
PIP_OFFLINE=(--no-index --find-links "$WHEELS" --no-compile)

TORCH_DIR="$WORK/torch"
if [ ! -d "$TORCH_DIR/torch" ]; then
  stage "install: torch, shared"
  echo "torch ($TORCH_SPEC) into $TORCH_DIR, shared by the virtualenvs"
  "$PY" -m pip install -q "${PIP_OFFLINE[@]}" --target "$TORCH_DIR" "$TORCH_SPEC"
fi

# A fresh virtualenv that sees the shared torch; $1 is its name.
fresh_venv() {
  local venv="$WORK/$1"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -c 'import site, sys; print(sys.argv[1], file=open(site.getsitepackages()[0] + "/shared-torch.pth", "w"))' "$TORCH_DIR"
  echo "$venv"
}
# Run a command in the virtualenv $1 with only its bin/ on PATH.
in_venv() {
  local venv="$1"
  shift
  env PATH="$venv/bin" VIRTUAL_ENV="$venv" "$@"
}
fail() {
  echo "install_check.sh: $*" >&2
  exit 1
}
# The extension listed as pip installed it, enabled and complete, in the virtualenv $1.
check_labextension() {
  local listing
  listing="$(in_venv "$1" jupyter labextension list 2>&1 | sed 's/\x1b\[[0-9;]*m//g')"
  echo "$listing"
  grep -Eq "oommagic v[0-9.]+ enabled .*OK \(python, oommagic\)" <<<"$listing" ||
    fail "jupyter labextension list in $1 does not show oommagic enabled OK (python, oommagic)"
  listing="$(in_venv "$1" jupyter server extension list 2>&1 | sed 's/\x1b\[[0-9;]*m//g')"
  grep -Eq "oommagic .*enabled" <<<"$listing" || { echo "$listing"; fail "the server extension is not enabled in $1"; }
  echo "server extension: $(grep -E "oommagic .*enabled" <<<"$listing" | head -1 | sed 's/^ *//')"
}
# The browser test in the app $2 of the virtualenv $1; Playwright itself runs on Node.js, the server not.
browser() {
  export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
  # A free port: a server of another run on the machine may hold the default one.
  local port
  port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  (cd "$ROOT/ui-tests" && { [ -d node_modules ] || "$WORK/lab/bin/jlpm" install --immutable; } &&
    OOMMAGIC_VENV="$1" OOMMAGIC_UI_APP="$2" OOMMAGIC_UI_ROOT="$(mkdir -p "$WORK/ui-$2" && echo "$WORK/ui-$2")" \
    OOMMAGIC_UI_PORT="$port" "$WORK/lab/bin/jlpm" playwright test -c playwright.install.config.ts)
}

stage "install: term: pip install oommagic; ipython"
VENV="$(fresh_venv term)"
in_venv "$VENV" python -m pip install -q "${PIP_OFFLINE[@]}" "$WHEEL"
in_venv "$VENV" /bin/sh -c "command -v node" >/dev/null && fail "node is on the virtualenv's PATH"
[ -x "$VENV/bin/ipython" ] || fail "pip install oommagic left no ipython command"
# A terminal session, typed in: a blank line ends the cell magic, the next one runs it.
TRANSCRIPT="$(printf '%s\n' '%load_ext oommagic' '%%gpumem --limit 64MiB' 'import torch' \
  'x = torch.empty(96 * 2**20, dtype=torch.uint8)' '' '' 'exit' |
  in_venv "$VENV" ipython --simple-prompt --colors=NoColor 2>&1)"
echo "$TRANSCRIPT" | grep -E "OUT OF MEMORY" || {
  echo "$TRANSCRIPT"
  fail "terminal IPython did not print the %%gpumem report"
}

stage "install: lab: pip install oommagic[lab]"
VENV="$(fresh_venv lab)"
in_venv "$VENV" python -m pip install -q "${PIP_OFFLINE[@]}" "$WHEEL[lab]"
check_labextension "$VENV"
[ -n "${OOMMAGIC_SKIP_UI:-}" ] || browser "$VENV" lab

stage "install: notebook: pip install oommagic beside Notebook 7"
VENV="$(fresh_venv notebook)"
in_venv "$VENV" python -m pip install -q "${PIP_OFFLINE[@]}" "notebook>=7,<8"
in_venv "$VENV" python -m pip install -q "${PIP_OFFLINE[@]}" "$WHEEL"
check_labextension "$VENV"
[ -n "${OOMMAGIC_SKIP_UI:-}" ] || browser "$VENV" notebook
echo "== install stories ok"
