#!/usr/bin/env bash
# The runtime's Python per step (bench/profile_step.py's row), demo GPT at world 2, main-thread CPU time: FSDP2,
# DeepSpeed ZeRO-3 and ours (main) in one call, and ours before issue 22 (37c9629) in a worktree, alternated, the
# order of the systems reversed in even rounds (run with ROUNDS="1 2 3", then ROUNDS="4 5 6"). The worktree runs
# main's profile_step.py (copied as bench/profile_step_main.py); its bench/_worker.py got main's probe_runner and its
# zero3 runner a close() calling engine.destroy() (as in issue22_quiet_1204). DeepSpeed is not a dependency: it was
# installed beside the venv with
#   pip install --target /tmp/dssite --no-deps deepspeed hjson py-cpuinfo msgpack einops
#   setup: git worktree add /tmp/wt_main HEAD; git worktree add /tmp/wt_before 37c9629 (+ the two edits above)
OUT=${OUT:-/tmp/runtime_python}; mkdir -p $OUT
PY=/work/main/.venv/bin/python
profile() {  # tree, script, systems, output
  (cd $1 && PYTHONPATH=/tmp/dssite:$1 DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 timeout 900 $PY $2 --size demo --world 2 \
     --systems $3 --clock thread --steps 20 > $4 2>/dev/null)
  echo "$4 done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
}
for r in ${ROUNDS:-1 2 3}; do
  if [ $((r % 2)) = 0 ]; then
    profile /tmp/wt_main bench/profile_step.py zero3,deepspeed,fsdp2 $OUT/main_run$r.md
    profile /tmp/wt_before bench/profile_step_main.py zero3 $OUT/before_run$r.md
  else
    profile /tmp/wt_before bench/profile_step_main.py zero3 $OUT/before_run$r.md
    profile /tmp/wt_main bench/profile_step.py fsdp2,deepspeed,zero3 $OUT/main_run$r.md
  fi
done
