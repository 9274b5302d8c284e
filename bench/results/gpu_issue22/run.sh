#!/usr/bin/env bash
# Issue 22's GPU run: host syncs and the launch-bound demo step (main vs 177a772, the tree before the issue's work),
# the 1.1B step (main vs 177a772, FSDP2), make gpu-check's CUDA tests, the reuse-distance-0 world-8 peak, compiled.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/res
save() { tar czf "$OUT/results.tgz" -C /tmp res; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
main() { PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout 150 "${@:2}"; save; }
old() { (cd .gpu_old && PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout 150 "${@:2}"); save; }
el demo; main 170 --size demo --parts syncs,zero3,torch,fsdp2 --warmup 5 --steps 30 --out /tmp/res/main_demo
el demo-old; old 80 --size demo --parts syncs,zero3 --warmup 5 --steps 30 --out /tmp/res/old_demo
el 1b; main 110 --parts zero3,fsdp2 --out /tmp/res/main_1b
el 1b-old; old 60 --parts zero3 --out /tmp/res/old_1b
el tests
PYTHONPATH=$PWD:/tmp/site timeout 170 python3 -m pytest -q -rs -p no:cacheprovider --timeout 100 --durations 8 \
  tests/test_cuda.py tests/test_device.py tests/test_ops.py \
  -k "cuda or fused or device or stream or pinned or save_16bit or fingerprint or place" > /tmp/res/pytest.log 2>&1
echo "pytest 1 rc $?" >> /tmp/res/pytest.log; save
PYTHONPATH=$PWD:/tmp/site timeout 90 python3 -m pytest -q -rs -p no:cacheprovider --timeout 80 --durations 5 \
  tests/test_host_syncs.py tests/test_offload_optimizer.py tests/test_offload_param.py tests/test_precision.py \
  -k cuda >> /tmp/res/pytest.log 2>&1
echo "pytest 2 rc $?" >> /tmp/res/pytest.log; tail -25 /tmp/res/pytest.log; save
el extra; main 70 --parts fake8_zero3_reuse0,zero3_compiled --out /tmp/res/main_extra
el extra-old; old 50 --parts zero3_compiled --out /tmp/res/old_extra
el done
