# Issue 22, 2026-12-04 16:44-17:27 UTC: gloo's all-gathers (and world 2's reduce-scatters) as all-to-alls.
# "before" = 7869777 in a worktree (/tmp/wt_before), "after" = main with the change; each tree's own code
# (PYTHONPATH), alternated. docs/benchmarks.md, "gloo's all-gathers, and world 2's reduce-scatters, as all-to-alls".
for W in 2 4; do
  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node $W bench/all_to_all_probe.py > probe_w$W.txt
done
for r in 1 2 3; do
  for t in before after; do
    d=/work/main; [ $t = before ] && d=/tmp/wt_before
    (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 python bench/compare.py --sizes demo --worlds 2,4 --systems ddp,zero3 \
        --rounds 3 --doc '' --chart '' --json demo_${t}_$r.json)
  done
done
for t in before after; do
  d=/work/main; [ $t = before ] && d=/tmp/wt_before
  (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 python bench/compare.py --sizes 100m --worlds 2 --systems ddp,fsdp2,zero3 \
      --rounds 2 --doc '' --chart '' --json c100m_$t.json)
done
# split.jsonl: three rounds of bench/cpu_split.py, zero3 in each tree and ddp, worlds 2 and 4 (16:44-16:48 UTC):
#   PYTHONPATH=$d OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node $W \
#       bench/cpu_split.py --system zero3|ddp      # one JSON line each, "tree" and "world" added
# Three more runs of main alone, right after (17:40-17:47 UTC), to see the spread: demo_after_4..6.json
for r in 4 5 6; do
  OMP_NUM_THREADS=1 python bench/compare.py --sizes demo --worlds 2,4 --systems ddp,zero3 --rounds 3 --doc '' \
      --chart '' --json demo_after_$r.json
done
