#!/usr/bin/env bash
# Third call of the third GPU run: fake_world's waits ordered like NCCL's; the world-8 peaks; the new test on the
# tree before the fix (it must fail there).
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
T="tests/test_testing.py -k fake_world"
timeout 40 python3 -m pytest -q -rs -p no:cacheprovider --timeout 30 $T > $OUT/pytest_after.log 2>&1
echo "pytest rc $?" >> $OUT/pytest_after.log; tail -3 $OUT/pytest_after.log
timeout 100 python3 bench/gpu_check.py --part-timeout 45 --parts fake8_zero3,fake8_zero3_reuse0 --out $OUT/main_fake8 >/dev/null 2>&1
grep -v "^$" $OUT/main_fake8.md | sed -n '/world 8/,$p'
# _fake_before.py was `git show 28747e4:zero_engine/testing/_fake.py`, carried beside this script for the run
cp bench/results/gpu_issue22_run3/_fake_before.py zero_engine/testing/_fake.py
timeout 40 python3 -m pytest -q -rs -p no:cacheprovider --timeout 30 $T > $OUT/pytest_before.log 2>&1
echo "pytest rc $?" >> $OUT/pytest_before.log; grep -E "FAILED|passed|failed|Error" $OUT/pytest_before.log | tail -4
