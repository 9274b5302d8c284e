for r in 1 2 3; do
  for t in before first main; do
    d=/work/main; [ $t = before ] && d=/tmp/wt_before; [ $t = first ] && d=/tmp/wt_177
    (cd $d && PYTHONPATH=$d OMP_NUM_THREADS=1 timeout 600 /work/main/.venv/bin/python bench/profile_step.py --size demo --world 2 --systems zero3 --clock thread --steps 20 --top 600 > /tmp/p9/profile_${t}_run$r.txt 2>&1)
    echo "$t $r done $(date +%T) $(uptime | sed 's/.*average://')"
  done
done
