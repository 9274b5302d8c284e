#!/usr/bin/env bash
# The fourth GPU run's second device session: where the compiled 1.1B step (ours 130 ms, FSDP2 compiled 111-125 ms in
# the fourth run) and the launch-bound demo step (1.07x FSDP2) spend their time, by torch.profiler op tables
# (bench/gpu_check.py --profile). Stages in priority order, each only if it fits before DEADLINE s.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCH_EXTENSIONS_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=/tmp/res; mkdir -p $R; DEADLINE=${DEADLINE:-200}
save() { tar czf "$OUT/res.tgz" -C /tmp res; }
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a $R/times.txt; }
fits() { [ $(( $(date +%s) - T0 + $1 )) -le $DEADLINE ] || { el "skip $2 (bound $1 s)"; return 1; }; }
main() { PYTHONPATH=$PWD:/tmp/site timeout "$1" python3 bench/gpu_check.py --part-timeout "$2" --profile $R/prof \
  "${@:3}" > /dev/null 2>&1; }
el compiled; fits 120 compiled && main 120 75 --parts zero3_compiled,fsdp2_compiled --out $R/compiled; save
el demo; fits 45 demo && main 45 25 --size demo --warmup 5 --steps 30 --parts zero3,fsdp2 --out $R/demo; save
el eager; fits 70 eager && main 70 40 --parts zero3,fsdp2 --out $R/eager; save
el done; save
grep -h "|" $R/*.md | grep -v "not run\|---" ; for f in $R/prof/*.txt; do echo "## $f"; head -22 "$f" | cut -c1-150; done
