cd /tmp/p9
for r in 1 2 3; do
  for t in before main; do
    d=/work/main; s=bench/profile_step.py; [ $t = before ] && { d=/tmp/wt_before; s=bench/profile_step_main.py; }
    (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 timeout 600 /work/main/.venv/bin/python $s --size demo --world 2 --systems zero3 --clock thread --steps 20 --top 600 > /tmp/p9/profile_${t}_run$r.txt 2>&1)
    echo "$t $r done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
