#!/usr/bin/env bash
# Large gathers as sends and receives above world 2 (docs/benchmarks.md, "Large gathers as sends and receives above
# world 2"). Run from the repository root; BASE is a worktree of main before the change:
#   git worktree add /tmp/base b3c184f
set -euo pipefail
D=bench/results/issue22_large_p2p_1206
BASE=${BASE:-/tmp/base}
PY=$PWD/.venv/bin/python
# per call: gloo's all-gather against sends and receives, 2-8M fp32 elements, worlds 4 and 3
for w in 4 3; do
    OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node $w bench/all_to_all_probe.py --large \
        2>&1 | grep -v Warn > $D/probe_large_w$w.txt
done
# the 100m model at world 4, before and after, alternated
for i in 1 2 3; do
    (cd $BASE && OMP_NUM_THREADS=1 PYTHONPATH=$BASE $PY bench/compare.py --sizes 100m --worlds 4 --systems ddp,zero3 \
        --rounds 1 --doc '' --chart '' --json $OLDPWD/$D/compare_100m_w4_before_$i.json)
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD $PY bench/compare.py --sizes 100m --worlds 4 --systems ddp,zero3 \
        --rounds 1 --doc '' --chart '' --json $D/compare_100m_w4_after_$i.json
done
# rank 0's CPU a step at world 4 (load-robust: CPU time, not wall), before and after, alternated
for i in 1 2 3; do
    for tree in $BASE $PWD; do
        OMP_NUM_THREADS=1 PYTHONPATH=$tree $PY -m torch.distributed.run --standalone --nproc_per_node 4 \
            bench/cpu_split.py --system zero3 --size 100m --steps 5 --warmup 2 2>/dev/null \
            | tail -1 | sed "s|^|$([ $tree = $BASE ] && echo before || echo after) |" >> $D/cpu_split_100m_w4.jsonl
    done
done
