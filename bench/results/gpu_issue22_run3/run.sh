#!/usr/bin/env bash
# Issue 22's third GPU run (one command, results under $OUT/res as each stage ends). main = this tree; old = 177a772
# (the tree before issue 22) with this tree's bench/gpu_check.py copied in, so both run the same parts and configs.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=$OUT/res; mkdir -p $R; cp bench/gpu_check.py .gpu_old/bench/gpu_check.py
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $R/device.txt
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $R/times.txt; }
# main|old OUTER_S PART_S ARGS: each part is killed by gpu_check at PART_S (no orphan); OUTER_S bounds the call
main() { PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" "${@:3}" > /dev/null 2>&1; }
old() { (cd .gpu_old && PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" "${@:3}" > /dev/null 2>&1); }
D="--size demo --warmup 5 --steps 30"
el tests
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m pytest -q -rs -p no:cacheprovider --timeout 100 --durations 6 \
  tests/test_host_syncs.py tests/test_cuda.py -k "synchronize and not fp16 or parity_on_cuda and bf16" \
  > $R/pytest.log 2>&1; echo "pytest rc $?" >> $R/pytest.log; tail -4 $R/pytest.log
el demo-main; main 110 50 $D --parts syncs,zero3,fsdp2 --out $R/main_demo
el demo-old;  old 40 35 $D --parts zero3 --out $R/old_demo
el fake8; main 85 45 --parts fake8_zero3,fake8_zero3_reuse0 --out $R/main_fake8
el compiled-main; main 80 75 --parts zero3_compiled --out $R/main_compiled
el compiled-old;  old 80 75 --parts zero3_compiled --out $R/old_compiled
el csan
PYTHONPATH=$PWD:/tmp/site TORCH_CUDA_SANITIZER=1 OMP_NUM_THREADS=1 timeout 40 python3 -m torch.distributed.run \
  --standalone --nproc_per_node 2 tests/cuda_parity_worker.py gloo bf16 $R/csan.json > $R/csan.log 2>&1
echo "csan rc $?" >> $R/csan.log
el done
for f in $R/*.md; do echo "## $f"; cat "$f"; done 2>/dev/null | grep -v "^$" | head -80
