#!/usr/bin/env bash
# 2026-12-04, the first session with a GPU since run8: one device command (15 minutes of device time in all).
# run9's plan (every part of bench/gpu_check.py on the current main, DeepSpeed's included, refreshing
# bench/results/gpu_check.{json,md}), then, if the deadline allows, make gpu-check's CUDA parity tests (gloo at
# world 2 with CUDA tensors keeps gloo's own all-gather since f2b988d: these tests run that path).
#   run: bash bench/results/gpu_issue22_run10/run.sh    (carry .whl; timeout_s 560)
#   prepare: as run9 (WITH_DEEPSPEED=1 ../shared/gpu/wheels.sh; deepspeed's wheel built with .venv's python)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a "$OUT/times.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
PARTS=zero3,fsdp2,deepspeed,zero3_compiled,fsdp2_compiled,fake8_zero3,fake8_fsdp2,fake8_zero3_reuse0,syncs,torch,adam
el gpu_check
timeout 430 python3 bench/gpu_check.py --part-timeout 90 --parts $PARTS --out "$OUT/gpu_check" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc $?"
el tests
LEFT=$(( 530 - $(date +%s) + T0 ))
[ $LEFT -gt 40 ] && timeout $LEFT python3 -m pytest -q -rs -p no:cacheprovider --timeout 100 tests/test_cuda.py \
  -k "parity" > "$OUT/pytest_parity.log" 2>&1; echo "pytest rc $? (bound $LEFT s)" >> "$OUT/pytest_parity.log"
el done
tail -3 "$OUT/pytest_parity.log"
grep "|" "$OUT/gpu_check.md"
