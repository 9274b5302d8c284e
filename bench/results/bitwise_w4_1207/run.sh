#!/bin/bash
# make demo's losses on main against main before issue 22 (37c9629, a worktree at /work/wt0), worlds 2 and 4, then
# the first commit whose world-4 losses differ (git bisect, 16 steps; bisect_w4.sh judges one commit).
set -e
for tree in /work/wt0 /work/main; do
  for w in 2 4; do
    (cd "$tree" && PYTHONPATH="$tree" OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
      --nproc_per_node "$w" examples/train_gpt.py --config examples/configs/zero3.json \
      --losses "/tmp/bitwise/$(basename "$tree")-w$w.json")
  done
done
cmp /tmp/bitwise/wt0-w2.json /tmp/bitwise/main-w2.json   # equal
cmp /tmp/bitwise/wt0-w4.json /tmp/bitwise/main-w4.json || true   # differ: 8 of 40 losses, by at most 9.5e-7
# ref16.json: 37c9629 at world 4 with --steps 16; then, in a worktree /work/wtb:
#   git bisect start 8727f12 37c9629 && git bisect run bisect_w4.sh   # -> d0af338 (bisect_log.txt)
