#!/usr/bin/env bash
# Issue 22's fourth GPU run, one device command. main = this tree; old = 37c9629 (main before any of issue 22's
# work) with this tree's bench/gpu_check.py copied in. Stages in priority order; a stage starts only if its bound
# fits before DEADLINE s; results are tarred into $OUT/res.tgz after every stage (the tool returns <= 8 files).
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=/tmp/res; mkdir -p $R; DEADLINE=${DEADLINE:-545}
save() { tar czf "$OUT/res.tgz" -C /tmp res; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $R/device.txt
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $R/times.txt; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -le $DEADLINE ] || { el "skip $2 (bound $1 s)"; return 1; }; }
main() { PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" "${@:3}" > /dev/null 2>&1; }
old() { (cd .gpu_old && PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" "${@:3}" > /dev/null 2>&1); }
PT="python3 -m pytest -q -rs -p no:cacheprovider --durations 6"
D="--size demo --warmup 5 --steps 30"
# 1. make gpu-check's CUDA tests, in two concurrent halves (correctness only; nothing timed runs beside them)
el tests
( PYTHONPATH=$PWD:/tmp/site timeout 170 $PT --timeout 100 tests/test_cuda.py -k parity > $R/pytest_parity.log 2>&1
  echo "rc $?" >> $R/pytest_parity.log ) &
( PYTHONPATH=$PWD:/tmp/site timeout 170 $PT --timeout 80 tests/test_host_syncs.py tests/test_offload_optimizer.py \
    tests/test_offload_param.py tests/test_precision.py -k cuda > $R/pytest_rest.log 2>&1
  echo "rc $?" >> $R/pytest_rest.log
  PYTHONPATH=$PWD:/tmp/site timeout 100 $PT --timeout 80 tests/test_cuda.py tests/test_device.py tests/test_ops.py \
    -k "(cuda or fused or device or stream or pinned or save_16bit or fingerprint or place) and not parity" \
    >> $R/pytest_rest.log 2>&1; echo "rc $?" >> $R/pytest_rest.log ) &
wait; tail -3 $R/pytest_parity.log; grep -E "passed|failed|^rc|FAILED" $R/pytest_rest.log; save
# 2. the launch-bound demo step, the whole issue (37c9629 -> main), alternated, three runs a tree
el demo-main-1; fits 110 demo && main 110 60 $D --parts syncs,zero3,fsdp2 --out $R/main_demo1; save
for i in 1 2 3; do
  [ $i = 1 ] || { el demo-main-$i; fits 45 demo && main 45 40 $D --parts zero3 --out $R/main_demo$i; save; }
  el demo-old-$i; fits 45 demo && old 45 40 $D --parts zero3 --out $R/old_demo$i; save
done
# 3. the 1.1B eager step against FSDP2
el 1b; fits 120 1b && main 120 70 --parts zero3,fsdp2 --out $R/main_1b; save
# 4. compiled blocks, ours and FSDP2's
el compiled; fits 160 compiled && main 160 78 --parts zero3_compiled,fsdp2_compiled --out $R/main_compiled; save
# 5. the sanitizer on a world-2 run
el csan
fits 40 csan && { PYTHONPATH=$PWD:/tmp/site TORCH_CUDA_SANITIZER=1 OMP_NUM_THREADS=1 timeout 40 python3 -m \
  torch.distributed.run --standalone --nproc_per_node 2 tests/cuda_parity_worker.py gloo bf16 $R/csan.json \
  > $R/csan.log 2>&1; echo "csan rc $?" >> $R/csan.log; }
el done; save
for f in $R/*.md; do echo "## $f"; grep -v "^$" "$f" | grep -v "^#\|^Command"; done 2>/dev/null | head -70
