#!/usr/bin/env bash
# The GPU run: one command on a CUDA machine, about 9 minutes at most. Stages in order of priority,
# each time-boxed with `timeout` and guarded (a failing stage does not stop the next):
#   1 GPU tests (tests/gpu)   2 capture overhead   3 recovery after OOM   4 batch search (and the
#   memory curve it predicts)   5 notebooks through nbclient on the GPU   6 NVML, %gpumem, the server
#   route with and without token
# Results stream into $OUT as they come:
#   gpu_tests.log, capture_overhead.{md,png}, recovery.{md,png}, batch_search.{md,png}, run.log
# (eight files, as many as the device tool brings back; run.log: every other stage's output, the memory
# curve and trace cost tables, the NVML JSON, the stage table and the summary). The summary
# table of every goal (measured vs goal, pass/MISS) is printed last.
#
# Knobs: GPU_RUN_BUDGET (seconds for everything, default 525), SCENARIOS (runner flags for the scenario
# stage), GPU_RUN_STAGES (comma-separated stage
# names to run, default all), GPU_RUN_NOTEBOOKS (the notebooks to run, default all), PYTHON (default python3),
# GPU_RUN_SKIP_INSTALL=1 (use what is installed), BENCH_ARGS (extra benchmark flags, e.g. --smoke to
# try this script on a CPU machine).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}
if [ -z "${GPU_RUN_SKIP_INSTALL:-}" ]; then
  "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
case ":$PYTHONPATH:" in *":$PWD:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$PWD ;; esac
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
BUDGET=${GPU_RUN_BUDGET:-525}
OUT=${OUT:-$PWD/benchmarks/results}
mkdir -p "$OUT"
export OUT
RUNLOG=$OUT/run.log
TESTLOG=$OUT/gpu_tests.log
: >"$RUNLOG"
: >/tmp/oommagic_notebooks.txt
STAGES=()
read -r -a EXTRA <<<"${BENCH_ARGS:-}"

say() { echo "$*" | tee -a "$RUNLOG"; }

# stage NAME LIMIT_S LOGFILE CMD...: runs CMD under `timeout`, never longer than what the budget has
# left (8 s are kept for the summary), appending its output to LOGFILE.
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [ -n "${GPU_RUN_STAGES:-}" ] && [[ ",$GPU_RUN_STAGES," != *",$name,"* ]]; then
    say "== $name: not selected (GPU_RUN_STAGES)"
    return
  fi
  local left=$((BUDGET - SECONDS - 8))
  local t=$((limit < left ? limit : left))
  if ((t < 5)); then
    say "== $name: skipped, no time left"
    STAGES+=("$name|skipped|0")
    return
  fi
  say "== $name (up to ${t}s, at ${SECONDS}s)"
  echo "== $name" >>"$log"
  local start=$SECONDS
  timeout -k 5 "$t" "$@" >>"$log" 2>&1
  local rc=$?
  ((rc == 124 || rc == 137)) && echo "== $name: TIMED OUT after ${t}s" >>"$log"
  STAGES+=("$name|$rc|$((SECONDS - start))")
  say "== $name: rc=$rc in $((SECONDS - start))s"
}

say "oommagic GPU run $(date -u +%FT%TZ) on $(hostname); budget ${BUDGET}s; wheels installed by ${SECONDS}s"
{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  "$PY" -c "import IPython, ipywidgets, transformers; print('IPython', IPython.__version__, 'ipywidgets', ipywidgets.__version__, 'transformers', transformers.__version__)"
} >>"$RUNLOG" 2>&1

# 1. GPU tests (~90 s): -rA lists every outcome at the end, for the summary.
: >"$TESTLOG"
stage "GPU tests" 240 "$TESTLOG" "$PY" -m pytest tests/gpu -s -v -rA -p no:cacheprovider -W ignore::pytest.PytestConfigWarning

# The scenario suite: realistic notebooks scored by clicks from the error to a fitting run
# (benchmarks/scenarios; SCENARIOS picks some, e.g. "--only plain_loop --only hf_trainer").
read -r -a PICK <<<"${SCENARIOS:-}"
stage "scenarios" 560 "$RUNLOG" "$PY" benchmarks/scenarios/run.py --scale gpu "${PICK[@]}"
stage "scan cost" 40 "$RUNLOG" "$PY" benchmarks/scan_cost.py

# 2-4. Benchmarks: each writes <name>.md and <name>.png into $OUT and prints SUMMARY lines.
stage "capture overhead" 80 "$RUNLOG" "$PY" benchmarks/capture_overhead.py --budget 60 "${EXTRA[@]}"
# 6. NVML as the package reads it, %gpumem in an in-process shell, the server route (~15 s).
stage "NVML" 20 "$RUNLOG" bash -c '
  echo "--- nvml.json"
  "$0" -c "from oommagic.devices import read_devices; import json; print(json.dumps(read_devices().to_json()))"
  echo "--- %gpumem"
  "$0" -c "
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.run_line_magic(\"load_ext\", \"oommagic\")
ip.run_cell(\"import torch\\nx = torch.ones(256 * 1024**2, device=\\\"cuda\\\" if torch.cuda.is_available() else \\\"cpu\\\")\")
ip.run_cell(\"%gpumem\")
"' "$PY"
stage "server route" 25 "$RUNLOG" bash -c '
  token=oommagic-gpu-run-$$; port=18765
  echo "c.ServerApp.jpserver_extensions = {\"oommagic\": True}" >/tmp/oommagic_server_config.py
  "$0" -m jupyter_server --config=/tmp/oommagic_server_config.py --ServerApp.token=$token \
    --ServerApp.ip=127.0.0.1 --ServerApp.port=$port --ServerApp.port_retries=0 \
    --ServerApp.open_browser=False --ServerApp.root_dir=/tmp --allow-root >/tmp/oommagic_server.log 2>&1 &
  server=$!
  fetch() { # URL [TOKEN]: prints the body and the HTTP status
    "$0" -c "
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], headers={\"Authorization\": \"token \" + sys.argv[2]} if len(sys.argv) > 2 else {})
try:
    r = urllib.request.urlopen(req, timeout=5); print(r.read().decode()[:3000]); print(\"HTTP\", r.status)
except urllib.error.HTTPError as e:
    print(e.read().decode()[:300]); print(\"HTTP\", e.code)
" "$@"
  }
  for _ in $(seq 1 60); do
    fetch "http://127.0.0.1:$port/api/status" "$token" 2>/dev/null | grep -q "HTTP 200" && break
    sleep 0.25
  done
  echo "--- GET /oommagic/devices with the token"; fetch "http://127.0.0.1:$port/oommagic/devices" "$token"
  echo "--- GET /oommagic/devices without a token"; fetch "http://127.0.0.1:$port/oommagic/devices"
  if command -v curl >/dev/null; then
    echo "--- curl with the token: HTTP $(curl -s -o /dev/null -w "%{http_code}" -H "Authorization: token $token" "http://127.0.0.1:$port/oommagic/devices")"
    echo "--- curl without a token: HTTP $(curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$port/oommagic/devices")"
  fi
  kill $server; wait $server 2>/dev/null
  echo "--- server log (tail)"; tail -n 15 /tmp/oommagic_server.log' "$PY"


stage "recovery" 45 "$RUNLOG" "$PY" benchmarks/recovery.py "${EXTRA[@]}"
stage "batch search" 130 "$RUNLOG" "$PY" benchmarks/batch_search.py --budget 110 "${EXTRA[@]}"
stage "memory curve" 50 "$RUNLOG" env OUT=/tmp/oommagic_extra "$PY" benchmarks/memory_curve.py "${EXTRA[@]}"
stage "trace cost" 30 "$RUNLOG" env OUT=/tmp/oommagic_extra "$PY" benchmarks/trace_cost.py

# 5. Notebooks through nbclient, a real ipykernel on the GPU (~100 s): the quickstart first, each
# notebook time-boxed on its own so that one that hangs does not cost the others.
timeout 60 "$PY" -m ipykernel install --prefix /tmp/kp >>"$RUNLOG" 2>&1 || say "ipykernel install failed"
export JUPYTER_PATH=/tmp/kp/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
stage "notebooks" 150 "$RUNLOG" bash -c '
  failed=0
  for nb in ${GPU_RUN_NOTEBOOKS:-notebooks/quickstart.ipynb $(ls notebooks/*.ipynb | grep -v quickstart)}; do
    [ -f "$nb" ] || continue
    echo "--- $nb"
    start=$SECONDS
    timeout -k 3 45 "$0" scripts/run_notebook.py "$nb"
    rc=$?
    echo "--- $nb: rc=$rc in $((SECONDS - start))s"
    echo "NOTEBOOK | $nb | rc=$rc in $((SECONDS - start))s" >>/tmp/oommagic_notebooks.txt
    [ $rc -eq 0 ] || failed=1
  done
  exit $failed' "$PY"

# The summary, printed last (and kept at the end of run.log).
printf '%s\n' "${STAGES[@]}" >/tmp/oommagic_stages.txt
"$PY" - "$RUNLOG" "$TESTLOG" /tmp/oommagic_stages.txt "$SECONDS" /tmp/oommagic_notebooks.txt <<'EOF' | tee -a "$RUNLOG"
import re
import sys

runlog, testlog, stages, total, notebooks = sys.argv[1:6]
rows = []
for line in open(stages).read().splitlines():
    name, rc, secs = line.split("|")
    verdict = "pass" if rc == "0" else ("TIMEOUT" if rc in ("124", "137") else ("skipped" if rc == "skipped" else "MISS"))
    rows.append((f"stage: {name}", f"rc={rc}, {secs} s", "rc=0", verdict))
tests = open(testlog, errors="replace").read() if testlog else ""
for m in re.finditer(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S+?::.+?)(?: - (.*))?$", tests, re.M):
    outcome, test, why = m.group(1), m.group(2).split("::")[-1], (m.group(3) or "")[:60]
    rows.append((f"test: {test}", outcome.lower() + (f" ({why})" if why else ""), "passed", "pass" if outcome == "PASSED" else "MISS"))
counts = re.findall(r"^=+ (.*(?:passed|failed|error|skipped).*) in [\d.]+s", tests, re.M)
if counts:
    ok = "passed" in counts[-1] and not re.search(r"failed|error", counts[-1])
    rows.append(("GPU tests, all", counts[-1], "all passed", "pass" if ok else "MISS"))
for line in open(notebooks).read().splitlines():
    _, nb, result = [p.strip() for p in line.split("|")]
    rows.append((f"notebook: {nb}", result, "rc=0", "pass" if result.startswith("rc=0 ") else "MISS"))
for line in open(runlog, errors="replace").read().splitlines():
    if line.startswith("SUMMARY |"):
        parts = [p.strip() for p in line.split("|")[1:]]
        if len(parts) == 4:
            rows.append(tuple(parts))
heads = ("goal", "measured", "target", "verdict")
width = [min(max([len(h)] + [len(r[i]) for r in rows]), cap) for i, (h, cap) in enumerate(zip(heads, (58, 70, 28, 7)))]
cut = lambda s, w: s if len(s) <= w else s[: w - 1] + "…"
print(f"\n== SUMMARY ({total} s in all; details: gpu_tests.log, run.log, *.md)")
print(" | ".join(h.ljust(w) for h, w in zip(heads, width)))
print("-+-".join("-" * w for w in width))
for r in rows:
    print(" | ".join(cut(c, w).ljust(w) for c, w in zip(r, width)))
missed = sum(r[3] in ("MISS", "TIMEOUT") for r in rows)
print(f"{len(rows)} rows, {missed} missed")
EOF
