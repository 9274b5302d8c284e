#!/bin/bash
# One gradient pickup per unit (stage 3) against main before it (9de05ca, a worktree at /tmp/base), alternated.
# "main" below is 9de05ca with pickup.patch (this folder) applied: the change measured and then not landed
# (docs/benchmarks.md, "One gradient pickup per unit instead of a hook per parameter").
#   git worktree add /tmp/base 9de05ca
#   git apply bench/results/issue22_pickup_1206/pickup.patch   # in the tree run from
# Run from the repository root; each tree runs its own bench/profile_step.py with main's .venv.
set -e
OUT=bench/results/issue22_pickup_1206
PY=$PWD/.venv/bin/python
for run in 1 2 3; do
  for tree in base main; do
    dir=$PWD; [ $tree = base ] && dir=/tmp/base
    (cd $dir && uptime && PYTHONPATH=$dir OMP_NUM_THREADS=1 $PY bench/profile_step.py --size demo --world 2 \
      --systems zero3 --clock thread --steps 20 --top 600) > $OUT/profile_${tree}_run$run.txt 2>&1
  done
done

# The engine's entry points' CPU per step without a profiler (bench/engine_cpu.py), alternated, both trees timed by
# this script (--tree).
for run in 1 2 3 4 5; do
  for tree in base main; do
    args=""; [ $tree = base ] && args="--tree /tmp/base"
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node 2 \
      bench/engine_cpu.py --steps 30 --warmup 5 $args 2>/dev/null | grep '^{' | sed "s/^/$tree $run /" >> $OUT/engine_cpu.txt
  done
done

# The same on the many-small size (197 parameters in 16 leaf blocks, almost no compute): the engine's work per
# parameter and per unit.
for run in 1 2 3 4 5 6; do
  for tree in base main; do
    args=""; [ $tree = base ] && args="--tree /tmp/base"
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node 2 \
      bench/engine_cpu.py --size many-small --steps 30 --warmup 5 $args 2>/dev/null | grep '^{' \
      | sed "s/^/$tree $run /" >> $OUT/engine_cpu_many_small.txt
  done
done
