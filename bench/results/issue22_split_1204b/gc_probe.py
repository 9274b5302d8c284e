"""Python GC collections and their pauses during steady steps, per system (rank 0 prints); the probe behind
docs/benchmarks.md's "Python's garbage collector is not in the step" (run.sh beside it has the command)."""
import gc, os, sys, time, json
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "bench")); sys.path.insert(0, ROOT)
import torch, torch.distributed as dist
from _worker import probe_runner, init_process_group
from _common import SIZES

system, size, warm, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rank, world = init_process_group(system)
runner, batches = probe_runner(system, SIZES[size], warm + steps, rank, world)
events, t0 = [], {}
def cb(phase, info):
    if phase == "start":
        t0["t"] = time.perf_counter()
    else:
        events.append((info["generation"], time.perf_counter() - t0["t"], info["collected"]))
for i, (x, y) in enumerate(batches):
    if i == warm:
        gc.callbacks.append(cb); start = time.perf_counter()
    runner.step(x, y)
took = time.perf_counter() - start
gc.callbacks.remove(cb)
if rank == 0:
    by = {g: [0, 0.0, 0] for g in range(3)}
    for g, d, c in events:
        by[g][0] += 1; by[g][1] += d; by[g][2] += c
    print(json.dumps({"system": system, "steps": steps, "step_ms": took / steps * 1e3,
                      "tracked_objects": len(gc.get_objects()), "thresholds": gc.get_threshold(),
                      "per_gen": {g: {"collections": v[0], "pause_ms": round(v[1] * 1e3, 2), "collected": v[2]}
                                  for g, v in by.items()}}))
runner.close(); dist.destroy_process_group()
