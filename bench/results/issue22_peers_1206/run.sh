# Issue 22, 2026-12-06: a coalesced gather on gloo stages the other ranks' rows only ([Note: a gather that leaves
# this rank's row out] in zero_engine/zero/gather.py). "before" = 692b0a7 in a worktree (/tmp/base), "after" = main
# at 7cdcd9d; each tree's own code (PYTHONPATH), alternated. docs/benchmarks.md, "A gather that leaves this rank's
# row out".
# main_692b0a7_{1,2,3}.json: three runs of 692b0a7 alone at the session's start (23:33-23:42 UTC), load 0.5-3.4:
#   OMP_NUM_THREADS=1 python bench/compare.py --sizes demo --worlds 2,4 --systems ddp,zero3 --rounds 3 --doc "" \
#       --chart "" --json main_692b0a7_<N>.json
R=$PWD
for r in 1 2 3; do
  for t in before after; do
    d=/work/main; [ $t = before ] && d=/tmp/base
    (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 /work/main/.venv/bin/python bench/compare.py --sizes demo --worlds 2,4 \
        --systems ddp,zero3 --rounds 3 --doc '' --chart '' --json $R/demo_${t}_$r.json > /dev/null 2>&1)
  done
done
for t in before after; do
  d=/work/main; [ $t = before ] && d=/tmp/base
  (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 /work/main/.venv/bin/python bench/compare.py --sizes 100m --worlds 2 \
      --systems ddp,fsdp2,zero3 --rounds 2 --doc '' --chart '' --json $R/c100m_$t.json > /dev/null 2>&1)
done
# split.jsonl: three rounds of bench/cpu_split.py, zero3 in each tree and ddp, at world 2 and 4 (--waits at world 2)
for r in 1 2 3; do
  for W in 2 4; do
    for t in before after ddp; do
      d=/work/main; [ $t = before ] && d=/tmp/base
      s=zero3; [ $t = ddp ] && s=ddp
      (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m torch.distributed.run --standalone \
          --nproc_per_node $W bench/cpu_split.py --system $s $([ $W = 2 ] && [ $s = zero3 ] && echo --waits) 2>/dev/null \
          | grep '^{' | sed "s/^{/{\"tree\": \"$t\", \"world\": $W, /" >> $R/split.jsonl)
    done
  done
done
echo done > $R/done.txt
# engine_cpu_w{2,4}.txt: bench/engine_cpu.py, the main thread's CPU in the engine's entry points a step, alternated,
# three rounds (00:44-00:48 UTC), each tree's own zero_engine:
#   PYTHONPATH=$d OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node $W \
#       bench/engine_cpu.py --steps 30 --parts --tree $d
