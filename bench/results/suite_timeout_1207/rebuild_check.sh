#!/bin/bash
# usage: rebuild_check.sh COMMIT  -- in a worktree at COMMIT, with a fresh TORCH_EXTENSIONS_DIR: build CPU Adam from the
# tree, then run the engine_cpu test (its torchrun imports the package through a link) and count ninja builds
set -e
repo=$(git rev-parse --show-toplevel)
c=$1; wt=$repo/../wt_$c; ext=$(mktemp -d)
git -C $repo worktree add -q $wt $c; ln -s $repo/.venv $wt/.venv
cd $wt
export TORCH_EXTENSIONS_DIR=$ext PYTHONPATH=$wt OMP_NUM_THREADS=1
s=$(date +%s.%N); .venv/bin/python -c "from zero_engine.ops import load_op; load_op('cpu_adam')"; e=$(date +%s.%N)
echo "$c: first load (cold build) $(echo "$e - $s" | bc) s"
s=$(date +%s.%N); .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_profile_step.py -k engine_cpu 2>&1 | tail -1; e=$(date +%s.%N)
echo "$c: the test $(echo "$e - $s" | bc) s"
for d in $ext/*/; do echo "$c: $(basename $d): $(grep -c '\.so$\|cpu_adam.o' $d/.ninja_log 2>/dev/null || true) ninja log lines; compiled from: $(grep -o '/[^ ]*cpu_adam.cpp' $d/build.ninja)"; done
cd $repo; git worktree remove --force $wt; rm -rf $ext
