#!/usr/bin/env bash
# Next GPU run (prepared 2026-11-28, not yet run): does gathering each 1.1B block whole close the compiled gap to FSDP2?
# The fifth call's profiles (bench/results/gpu_issue22_run5/prof/) show ours issuing 127 all-gathers and 149
# _chunk_cat a compiled step at world 1, FSDP2 21 groups: each 1.1B block's four matrices (50.3M elements) exceed the
# 1b config's 50M prefetch bucket, so [Note: a unit is prefetched whole] falls back to one gather per parameter.
# Each part reports collectives_per_step. About 4 minutes of device time; stages only while they fit before DEADLINE.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=/tmp/res; mkdir -p $R; DEADLINE=${DEADLINE:-210}
save() { tar czf "$OUT/res.tgz" -C /tmp res; }
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $R/times.txt; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -le $DEADLINE ] || { el "skip $2 (bound $1 s)"; return 1; }; }
main() { PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" "${@:3}" > /dev/null 2>&1; }
WHOLE='{"stage3_prefetch_bucket_size": 60000000}'
el whole;   fits 70 whole   && main 70 65 --parts zero3_compiled --zero-optimization "$WHOLE" --out $R/whole; save
el default; fits 70 default && main 70 65 --parts zero3_compiled --out $R/default; save
el fsdp2;   fits 70 fsdp2   && main 70 65 --parts fsdp2_compiled --out $R/fsdp2; save
el done; save
grep -h "compiled |" $R/*.md | grep -v "not run"; grep -ho '"collectives_per_step": {[^}]*}' $R/*.json
