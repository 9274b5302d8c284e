# Issue 22, 2026-12-06: a peer gather as sends and receives above world 2 ([Note: gloo's peer gather as sends and
# receives] in zero_engine/comm/_backend.py). "before" = 6060743 in a worktree (/tmp/base), "after" = df80e2e
# (/work/main); each tree's own code (PYTHONPATH), alternated. docs/benchmarks.md, "A peer gather as sends and
# receives". no_threshold/: the same compare.py and cpu_split.py runs of a first version that also gathered units
# under 1 MiB (the embeddings) by sends and receives.
# probe_peers.txt: OMP_NUM_THREADS=1 torchrun --nproc_per_node W bench/all_to_all_probe.py --peers, W = 4, 3, 2.
R=$PWD
run() {  # tree, command...
  d=/work/main; [ $1 = before ] && d=/tmp/base
  shift
  (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 "$@")
}
# losses: make demo's 40 losses at world 4, each tree
for t in before after; do
  run $t /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 4 examples/train_gpt.py \
      --config examples/configs/zero3.json --losses $R/losses_w4_$t.json > /dev/null 2>&1
done
# split.jsonl: bench/cpu_split.py (rank 0's CPU a step: main thread / other threads), zero3 at world 4, three rounds
for r in 1 2 3; do
  for t in before after; do
    run $t /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 4 bench/cpu_split.py \
        --system zero3 2>/dev/null | grep '^{' | sed "s/^{/{\"tree\": \"$t\", /" >> $R/split.jsonl
  done
done
# engine_cpu_w4.txt: the main thread's CPU in the engine's entry points, three rounds
for r in 1 2 3; do
  for t in before after; do
    d=/work/main; [ $t = before ] && d=/tmp/base
    run $t /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 4 bench/engine_cpu.py \
        --steps 30 --parts --tree $d 2>/dev/null | grep '^{' | sed "s/^{/{\"tree\": \"$t\", /" >> $R/engine_cpu_w4.txt
  done
done
# demo_{before,after}_N.json: bench/compare.py, worlds 4 and 2, three rounds each, three pairs
for r in 1 2 3; do
  for t in before after; do
    run $t /work/main/.venv/bin/python bench/compare.py --sizes demo --worlds 4,2 --systems ddp,zero3 --rounds 3 \
        --doc '' --chart '' --json $R/demo_${t}_$r.json > /dev/null 2>&1
    uptime >> $R/load.txt
  done
done
echo done > $R/done.txt
# split_2.jsonl: the cpu_split.py rounds again (03:10 UTC), as above; split.jsonl's ran while the machine was
# slowed (its CPU times 1.3-1.5 x those of quieter runs).
for r in 1 2 3; do
  for t in before after; do
    run $t /work/main/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 4 bench/cpu_split.py \
        --system zero3 2>/dev/null | grep '^{' | sed "s/^{/{\"tree\": \"$t\", /" >> $R/split_2.jsonl
  done
done
