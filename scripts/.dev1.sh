python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
PYTHONFAULTHANDLER=1 timeout 150 python3 -m pytest -q -s -p no:cacheprovider -x tests/gpu/test_gpu_rank_plan.py -k lightning --runxfail > $OUT/full.txt 2>&1
grep -n -B3 -A25 "Fatal Python\|Segmentation\|Traceback\|trial 1:" $OUT/full.txt | head -150
