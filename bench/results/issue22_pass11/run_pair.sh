#!/bin/bash
# The record of the py-spy runs of 2026-11-28 03:03-03:12 UTC (bench/gil_split.py reads their raw outputs, 25 MB
# each, not kept): 37c9629 (main before issue 22, `git worktree add /tmp/wt_old 37c9629`) and main (ed34c67),
# alternated, three runs each. py-spy installed in its own venv (/tmp/pyspy), not in the project.
# alternated py-spy runs: old tree (37c9629) and main, 3 each
for r in 1 2 3; do
  for t in old main; do
    if [ $t = old ]; then dir=/tmp/wt_old; else dir=/work/main; fi
    cd $dir
    echo "$t run $r start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/spytools/runs.log
    PYTHONPATH=$dir OMP_NUM_THREADS=1 timeout 900 /tmp/pyspy/bin/py-spy record --subprocesses --gil -r 400 -f raw -o /tmp/spytools/${t}_$r.txt -- /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3.json --steps 120 > /tmp/spytools/${t}_$r.log 2>&1
    echo "$t run $r end $(date +%T) rc $?" >> /tmp/spytools/runs.log
  done
done
