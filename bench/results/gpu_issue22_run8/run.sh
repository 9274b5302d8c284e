#!/usr/bin/env bash
# Prepared 2026-11-28 (no GPU in that session), for the next session that has one: one device command.
# What it checks: FusedAdam scales the 16-bit gradient shards in its kernel (0f60418), so ZeRO's step makes no fp32
# copy of them. main = this tree; before = 2669b5f (main before that change), in .gpu_before (git archive 2669b5f).
#   1. make gpu-check's CUDA tests, the two new ones among them (test_ops.py ...grad_scale...[cuda-*] and
#      test_cuda.py::test_fused_adam_takes_bf16_gradient_shards_without_an_fp32_copy);
#   2. the 1.1B eager step at world 1 (bf16, FusedAdam), main and before alternated: the step should lose the
#      bf16 -> fp32 copies and the mul_ (about 7 ms in the fourth run's profile) and nothing else;
#   3. TORCH_CUDA_SANITIZER=1 on the parity worker at world 2 (gloo, one GPU).
#   run: DEADLINE=540 bash bench/results/gpu_issue22_run8/run.sh   (carry .whl and .gpu_before; timeout 580)
#   prepare, here in the repository root (both are ignored by git, so a new checkout has neither):
#     ../shared/gpu/wheels.sh
#     mkdir -p .gpu_before && git archive 2669b5f | tar -x -C .gpu_before && echo /.gpu_before/ >> .git/info/exclude
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=/tmp/res; mkdir -p $R; DEADLINE=${DEADLINE:-540}
save() { tar czf "$OUT/res.tgz" -C /tmp res; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $R/device.txt
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $R/times.txt; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -le $DEADLINE ] || { el "skip $2 (bound $1 s)"; return 1; }; }
main() { PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" "${@:3}" > /dev/null 2>&1; }
old() { (cd .gpu_before && PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" \
         "${@:3}" > /dev/null 2>&1); }
PT="python3 -m pytest -q -rs -p no:cacheprovider --durations 6"
el tests
( PYTHONPATH=$PWD:/tmp/site timeout 170 $PT --timeout 100 tests/test_cuda.py -k "parity or grouped or fused" \
    > $R/pytest_parity.log 2>&1; echo "rc $?" >> $R/pytest_parity.log ) &
( PYTHONPATH=$PWD:/tmp/site timeout 170 $PT --timeout 80 tests/test_host_syncs.py tests/test_offload_optimizer.py \
    tests/test_offload_param.py tests/test_precision.py -k cuda > $R/pytest_rest.log 2>&1
  echo "rc $?" >> $R/pytest_rest.log
  PYTHONPATH=$PWD:/tmp/site timeout 100 $PT --timeout 80 tests/test_cuda.py tests/test_device.py tests/test_ops.py \
    -k "(cuda or fused or device or stream or pinned or save_16bit or fingerprint or place) and not parity \
    and not grouped and not test_fused_adam_takes" >> $R/pytest_rest.log 2>&1; echo "rc $?" >> $R/pytest_rest.log ) &
wait; tail -3 $R/pytest_parity.log; grep -E "passed|failed|^rc|FAILED" $R/pytest_rest.log; save
el 1b-main-1; fits 80 1b && main 80 70 --parts zero3 --out $R/main_1b_1; save
el 1b-old-1;  fits 80 1b && old 80 70 --parts zero3 --out $R/old_1b_1; save
el 1b-old-2;  fits 80 1b && old 80 70 --parts zero3 --out $R/old_1b_2; save
el 1b-main-2; fits 80 1b && main 80 70 --parts zero3 --out $R/main_1b_2; save
# 3. the sanitizer on a world-2 run (owed since the fifth run: the turn's prefetch order, a475205)
el csan
fits 40 csan && { PYTHONPATH=$PWD:/tmp/site TORCH_CUDA_SANITIZER=1 OMP_NUM_THREADS=1 timeout 40 python3 -m \
  torch.distributed.run --standalone --nproc_per_node 2 tests/cuda_parity_worker.py gloo bf16 $R/csan.json \
  > $R/csan.log 2>&1; echo "csan rc $?" >> $R/csan.log; }
el done; save
grep -h "zero3 |" $R/*_1b_*.md
tail -3 $R/csan.log
