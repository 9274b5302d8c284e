#!/usr/bin/env bash
# Prepared 2026-12-04 for the next session with a GPU: one device command (about 480 s).
# Why: in the seventh run (run10) our compiled 1.1B step read 131.9, 101.0 and 115.0 ms in three processes, FSDP2's
# compiled step 110.5 (109.5 in the fifth run). Python's GC is ruled out on the CPU (one gen-0 collection in 40
# steady steps of ours compiled, none older). This run says whether a slow process is slow in every step
# (step_ms_each, new) and how much of a step the GPU spends in kernels (--profile's "GPU kernel time", new): if
# ours is host-bound when compiled, the kernels take well under the step and the spread is the host's.
#   run: bash bench/results/gpu_issue22_run11/run.sh    (carry .whl; timeout_s 560)
#   prepare: ../shared/gpu/wheels.sh (DeepSpeed not needed)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a "$OUT/times.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
run() { timeout 95 python3 bench/gpu_check.py --part-timeout 90 --steps 10 "$@" > /dev/null 2>&1; }
for i in 1 2 3; do   # alternated, each a fresh process
  el "zero3_compiled $i"; run --parts zero3_compiled --out "$OUT/ours$i"
  el "fsdp2_compiled $i"; run --parts fsdp2_compiled --out "$OUT/fsdp2_$i"
  [ $(( $(date +%s) - T0 )) -gt 330 ] && break
done
el profile
timeout 150 python3 bench/gpu_check.py --part-timeout 70 --steps 3 --parts zero3_compiled,fsdp2_compiled \
  --profile "$OUT/prof" --out "$OUT/prof_run" > "$OUT/prof.log" 2>&1
el done
grep -h "_compiled |" "$OUT"/*.md
grep -h "GPU kernel time" "$OUT"/prof/*.txt
