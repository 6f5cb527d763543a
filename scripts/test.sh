#!/usr/bin/env bash
# Every test on a fresh machine: Python (real IPython, real kernels, a real Jupyter server), the lab
# extension's unit tests, and the browser tests in Debian's headless Chromium. Prints each stage's time
# at the end. The Python tests run on every core (pytest-xdist; OOMMAGIC_TEST_WORKERS=0 runs them in one
# process); extra arguments go to pytest. OOMMAGIC_SKIP_UI=1 leaves the browser tests out.
set -euo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
source "$HERE/stages.sh"
trap 'stage_times test.sh' EXIT

stage "setup"
OOMMAGIC_EXTRAS="[test]" source "$HERE/setup.sh"
export PATH="$VENV/bin:$PATH"

stage "ruff"
ruff check oommagic tests benchmarks scripts
ruff format --check oommagic tests benchmarks scripts

stage "lab extension unit tests"
(cd labextension && jlpm test)

stage "python tests"
# A module's tests run together, in their order, on one worker; the slowest modules first
# (tests/conftest.py). The slowest tests are listed after the run. Side by side, torch's CPU ops take one
# thread per worker: with a thread per core in each worker, OpenMP's waiting threads take turns on the
# cores (two finetune notebooks side by side on 2 cores: 219 s with 2 threads each, 72 s with 1).
if [ "${OOMMAGIC_TEST_WORKERS:-auto}" != 0 ]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
python -m pytest -q -p no:cacheprovider -n "${OOMMAGIC_TEST_WORKERS:-auto}" --dist loadfile --durations 12 "$@"

if [ -z "${OOMMAGIC_SKIP_UI:-}" ]; then
  stage "browser tests"
  bash scripts/chromium.sh
  bash ui-tests/run.sh
fi
