#!/usr/bin/env bash
# Prepared 2026-12-04 for the next session that has a GPU: one device command. The sixth GPU run (run8, an H200)
# ran make gpu-check's tests and the eager 1.1B step of ours and FSDP2's; a third call for the rest of the benchmark
# was refused ("no new device machine is lent at present"). This one refreshes bench/results/gpu_check.{json,md}
# (still the first run's, on an H100, 2026-11-27) with every part on the current main, DeepSpeed's included.
#   run: bash bench/results/gpu_issue22_run9/run.sh    (carry .whl; timeout_s 560)
#   prepare, here in the repository root (.whl is ignored by git, so a new checkout has none):
#     WITH_DEEPSPEED=1 ../shared/gpu/wheels.sh
#     ls .whl | grep -q deepspeed || DS_BUILD_OPS=0 DS_ACCELERATOR=cpu .venv/bin/python -m pip wheel -q --no-deps \
#         --no-build-isolation -w .whl deepspeed       # wheels.sh builds it with a python that has torch only
#   then copy $OUT/gpu_check.{json,md} to bench/results/ and record the figures in docs/benchmarks.md.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The parts in the order of what they settle, so a deadline cuts the least useful ones (each part writes the JSON).
PARTS=zero3,fsdp2,deepspeed,zero3_compiled,fsdp2_compiled,fake8_zero3,fake8_fsdp2,fake8_zero3_reuse0,syncs,torch,adam
timeout 520 python3 bench/gpu_check.py --part-timeout 90 --parts $PARTS --out "$OUT/gpu_check" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc $?"
grep "|" "$OUT/gpu_check.md"
