#!/usr/bin/env bash
# The fifth GPU run (prepared 2026-11-28, ran 06:33 UTC on an H100; outputs in out/, figures in docs/benchmarks.md
# "Fifth GPU run"), one device command: what this session's two changes do to the
# compiled 1.1B step. main = this tree; before = 53e5db1 (main before them), in .gpu_before (git archive 53e5db1).
#   - compiled blocks now copy their gradients in a block at a time (67f60cb; was one copy per Linear: 149 a step);
#   - on NCCL the large parameters of a gather go out as one group (2af8cbe; was one all-gather each: 127 a step).
# Each zero3 part reports collectives_per_step. Stages in priority order; a stage starts only if its bound fits
# before DEADLINE s; results are tarred into $OUT/res.tgz after every stage.
#   run: DEADLINE=540 bash bench/results/gpu_issue22_run7/run.sh   (carry .whl and .gpu_before; timeout 580)
#   prepare, here in the repository root (both are ignored by git, so a new checkout has neither):
#     ../shared/gpu/wheels.sh                 (no DeepSpeed part here: WITH_DEEPSPEED=1 is not needed)
#     mkdir -p .gpu_before && git archive 53e5db1 | tar -x -C .gpu_before && echo /.gpu_before/ >> .git/info/exclude
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
# 1. make gpu-check's CUDA tests in two concurrent halves (the grouped NCCL gather's bitwise check runs in the second:
#    its name has neither "parity" nor "grouped")
el tests
( PYTHONPATH=$PWD:/tmp/site timeout 170 $PT --timeout 100 tests/test_cuda.py -k "parity or grouped" \
    > $R/pytest_parity.log 2>&1; echo "rc $?" >> $R/pytest_parity.log ) &
( PYTHONPATH=$PWD:/tmp/site timeout 170 $PT --timeout 80 tests/test_host_syncs.py tests/test_offload_optimizer.py \
    tests/test_offload_param.py tests/test_precision.py -k cuda > $R/pytest_rest.log 2>&1
  echo "rc $?" >> $R/pytest_rest.log
  PYTHONPATH=$PWD:/tmp/site timeout 100 $PT --timeout 80 tests/test_cuda.py tests/test_device.py tests/test_ops.py \
    -k "(cuda or fused or device or stream or pinned or save_16bit or fingerprint or place) and not parity \
    and not grouped" >> $R/pytest_rest.log 2>&1; echo "rc $?" >> $R/pytest_rest.log ) &
wait; tail -3 $R/pytest_parity.log; grep -E "passed|failed|^rc|FAILED" $R/pytest_rest.log; save
# 2. compiled blocks, 1.1B: before and main alternated, FSDP2 compiled between them
el compiled-main-1; fits 90 c && main 90 80 --parts zero3_compiled --out $R/main_compiled1; save
el compiled-old-1;  fits 90 c && old 90 80 --parts zero3_compiled --out $R/old_compiled1; save
el fsdp2-compiled;  fits 90 c && main 90 80 --parts fsdp2_compiled --out $R/fsdp2_compiled; save
el compiled-old-2;  fits 90 c && old 90 80 --parts zero3_compiled --out $R/old_compiled2; save
el compiled-main-2; fits 90 c && main 90 80 --parts zero3_compiled --out $R/main_compiled2; save
# 3. grouped against separate all-gathers on NCCL, by size (world 1)
el probe; fits 40 probe && { PYTHONPATH=$PWD:/tmp/site timeout 40 python3 -m torch.distributed.run --standalone \
  --nproc_per_node 1 bench/gather_probe.py --backend nccl > $R/gather_probe.txt 2>&1; }; save
# 4. the 1.1B eager step (bandwidth-bound: no regression expected)
el 1b; fits 80 1b && main 80 70 --parts zero3 --out $R/main_1b; save
el done; save
grep -h "compiled |" $R/*compiled*.md | grep -v "not run"; grep -ho '"collectives_per_step": {[^}]*}' $R/*.json
grep "|" $R/gather_probe.txt
