# The runs of docs/benchmarks.md, "A long run holds what a short one does" (from the project root; nvme_path of
# zero3_nvme.json must exist: mkdir -p /tmp/zero_engine_nvme). Each file keeps rank 0's lines.
run() { name=$1; config=$2; shift 2
  MALLOC_MMAP_THRESHOLD_=65536 PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
    --nproc_per_node 2 bench/soak.py --config examples/configs/$config.json --steps 1200 --every 300 \
    --eval-every 20 --save-every 100 --save-dir /tmp/zero_engine_soak "$@" | grep -E '^step|^\{' \
    > bench/results/soak_1206/$name.txt; }
run zero3 zero3
run zero3_bf16 zero3_bf16
run zero3_fp16 zero3_fp16
run zero2 zero2
run zero1 zero1
run zero3_gradient_accumulation_steps zero3 --set '{"gradient_accumulation_steps": 2}'
run zero3_step_fingerprint zero3 --set '{"zero_engine.step_fingerprint": false}'
run zero3_offload_optimizer zero3 --set '{"zero_optimization.offload_optimizer": {"device": "cpu"}}'
run zero3_bf16_offload_param_offload_optimizer zero3_bf16 \
  --set '{"zero_optimization.offload_param": {"device": "cpu"}, "zero_optimization.offload_optimizer": {"device": "cpu"}}'
run zero3_sequential zero3_sequential
run zero3pp zero3pp
run zero3_nvme zero3_nvme
# the longer run without evaluations or saves
MALLOC_MMAP_THRESHOLD_=65536 PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
  --nproc_per_node 2 bench/soak.py --config examples/configs/zero3.json --steps 3000 --every 250 \
  | grep -E '^step|^\{' > bench/results/soak_1206/zero3_3000_steps.txt
