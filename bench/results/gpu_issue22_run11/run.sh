#!/usr/bin/env bash
# Prepared 2026-12-04 for the next session with a GPU: one device command (about 500 s).
# Why: in the seventh run (run10) our compiled 1.1B step read 131.9, 101.0 and 115.0 ms in three processes, FSDP2's
# compiled step 110.5 (109.5 in the fifth run). Python's GC is ruled out on the CPU (one gen-0 collection in 40
# steady steps of ours compiled, none older). This run says whether a slow process is slow in every step
# (step_ms_each, new) and how much of a step the GPU spends in kernels (--profile's "GPU kernel time", new): if
# ours is host-bound when compiled, the kernels take well under the step and the spread is the host's.
# Then the demo GPT's step (host-bound on a GPU: ours 23.3 ms against FSDP2's 21.7 in the fourth run) under the
# profiler, its ops also sorted by the host's time (new).
#   run: bash bench/results/gpu_issue22_run11/run.sh    (carry .whl; timeout_s 560)
#   prepare: ../shared/gpu/wheels.sh (DeepSpeed not needed); afterwards: tar xzf <files_at>/res.tgz
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/res; mkdir -p $R   # at most 8 files come back from $OUT: everything goes into one archive, after each stage
save() { tar czf "$OUT/res.tgz" -C /tmp res; }
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a "$R/times.txt"; save; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/device.txt"
el "cuda tests"   # added 2026-12-07: the paths that meet host and device copies (offload, from_pretrained, edits)
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
  -k "edit_on_cuda or hf_offload or after_backward_on_cuda or cuda_rng_state" > "$R/cuda_tests.log" 2>&1; tail -3 "$R/cuda_tests.log"
run() { timeout 95 python3 bench/gpu_check.py --part-timeout 90 --steps 10 "$@" > /dev/null 2>&1; }
for i in 1 2 3; do   # alternated, each a fresh process
  el "zero3_compiled $i"; run --parts zero3_compiled --out "$R/ours$i"
  el "fsdp2_compiled $i"; run --parts fsdp2_compiled --out "$R/fsdp2_$i"
  [ $(( $(date +%s) - T0 )) -gt 300 ] && break
done
el profile
timeout 150 python3 bench/gpu_check.py --part-timeout 70 --steps 3 --parts zero3_compiled,fsdp2_compiled \
  --profile "$R/prof" --out "$R/prof_run" > "$R/prof.log" 2>&1
el "demo profile"   # the demo GPT, where the GPU waits on the CPU: the host's ops by self CPU time, ours and FSDP2's
timeout 100 python3 bench/gpu_check.py --part-timeout 45 --size demo --steps 20 --parts zero3,fsdp2 \
  --profile "$R/prof_demo" --out "$R/demo" > "$R/demo.log" 2>&1
el done
grep -h "_compiled |" $R/*.md
grep -h "GPU kernel time" $R/prof*/*.txt
