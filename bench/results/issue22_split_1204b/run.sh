# Issue 22, 2026-12-04 18:33-18:45 UTC, main 9e22a8f: where world 2's gap to DDP is now (docs/benchmarks.md,
# "World 2 after the all-to-alls: where the rest goes").
# split.jsonl: three rounds, zero3 then ddp alternated:
#   PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \
#       bench/cpu_split.py --system zero3|ddp
# the waits (one run): the same with --system zero3 --waits
# gc.jsonl: Python's collections in 40 steady steps after 5 warm-up steps (the first line at 18:40, the others at 18:30):
#   PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \
#       bench/results/issue22_split_1204b/gc_probe.py zero3|zero3-compile|fsdp2|fsdp2-compile demo 5 40
