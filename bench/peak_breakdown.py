"""Where the per-rank peak is, and what is live there: zero_engine ZeRO-3 vs FSDP2 at world 8 on the fake group.

    python bench/peak_breakdown.py --n-embd 512 --n-layer 20 --vocab 8192 --seq 512 --micro 2 \
        [--max-reuse-distance 1e9] [--world 8] [--runtimes zero3,fsdp2]

(that shape is gpu_check's 1.1B GPT scaled 1/16 in every ratio that matters; docs/benchmarks.md, "Where the world-8
peak gap comes from"). Each runtime runs in its own process: the model is built sharded (zero.Init / meta +
fully_shard) on torch's fake process group (shapes and allocations are real, no data moves), one warm-up step, then
one tracked step. Ours runs gpu_check's ``_zero3_config`` with its element counts scaled by (n_embd / 2048)^2.
The tracker is a TorchDispatchMode that records every storage an op creates (weakly, so a freed storage leaves the
count) and every ``UntypedStorage.resize_`` (how both runtimes gather into and release parameter storage), labelled
by allocation site: the innermost frame of the runtime (zero_engine/, torch/distributed/fsdp/) or of the model, or
"autograd" for what the backward pass itself allocates. At the step's peak of live bytes (those allocated during the
tracked step, on top of what existed before it: the model states less the gradient shards) it prints the live
bytes per site, then per category.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import weakref
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def _site(op_name: str) -> str:
    """The allocation site: innermost frame in a runtime or the model, else the op under autograd's backward."""
    frame = sys._getframe(2)  # innermost first; frame objects, not extract_stack (which reads source lines)
    while frame is not None:
        f = frame.f_code.co_filename
        if "zero_engine/testing/models.py" in f:
            return f"model:{frame.f_lineno} {frame.f_code.co_name} [{op_name}]"
        if "zero_engine/engine.py" not in f:  # the engine is the entry point (forward/backward/step), not a site
            for marker in ("zero_engine/", "torch/distributed/fsdp/", "torch/optim/"):
                if marker in f:
                    return f"{f[f.index(marker):]}:{frame.f_lineno} {frame.f_code.co_name} [{op_name}]"
        frame = frame.f_back
    return f"autograd [{op_name}]"


class LiveStorages(TorchDispatchMode):
    """Live bytes of the storages created (or grown by resize_) while active, by site; the peak and its snapshot."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, tuple[str, int]] = {}  # id(storage) -> (site, bytes counted)
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.peak_op = ""

    def _set(self, st: torch.UntypedStorage, nbytes: int, site: str) -> None:
        key = id(st)
        old_site, old = self.sizes.get(key, (site, 0))
        if key not in self.refs:
            self.refs[key] = weakref.ref(st, lambda _, k=key: self._drop(k))
        self.sizes[key] = (site if nbytes > old else old_site, nbytes)
        self.live += nbytes - old
        if self.live > self.peak:
            self.peak = self.live
            self.peak_op = site
            snap: dict[str, int] = defaultdict(int)
            for s, n in self.sizes.values():
                snap[s] += n
            self.at_peak = dict(snap)

    def _drop(self, key: int) -> None:
        _, n = self.sizes.pop(key, ("", 0))
        self.refs.pop(key, None)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        site = None
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if id(st) not in self.sizes and st.nbytes() > 0:
                    site = site or _site(name)
                    self._set(st, st.nbytes(), site)
        return out

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            tracker._orig_resize(st, size)
            tracker._set(st, size, _site("resize_") if size else tracker.sizes.get(id(st), ("", 0))[0])
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


def model_config(args):
    from zero_engine.testing.models import GPTConfig

    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_embd // 128,
                     n_embd=args.n_embd)


def run(args) -> dict:
    import gpu_check

    from zero_engine.testing import fake_world

    cfg = model_config(args)
    x, y = gpu_check.batch(cfg, args.micro, torch.device("cpu"))
    with fake_world(args.world):
        if args.runtime == "zero3":
            import zero_engine

            with zero_engine.zero.Init():
                model = gpu_check._build_model(cfg)
            config = gpu_check._zero3_config(args.micro)
            # gpu_check's element counts were chosen for blocks of 12 x 2048^2 = 5.0e7 parameters; keep them the
            # same number of blocks here (the defaults of max_live_parameters and max_reuse_distance, 1e9, too)
            scale = (args.n_embd / 2048) ** 2
            zc = config["zero_optimization"]
            zc.update(stage3_max_live_parameters=1e9, stage3_max_reuse_distance=args.max_reuse_distance)
            for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                        "stage3_max_live_parameters", "stage3_max_reuse_distance"):
                zc[key] = int(zc[key] * scale)
            engine, *_ = zero_engine.initialize(model=model, config=config)

            def step():
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
        else:
            from torch.distributed.device_mesh import init_device_mesh

            with torch.device("meta"):
                model = gpu_check._build_model(cfg)
            model = gpu_check._fully_shard(model, init_device_mesh("cpu", (args.world,)))
            model.to_empty(device="cpu")
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().normal_(0.0, 0.02)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

            def step():
                model(x, y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        step()  # warm-up: optimizer states and the trace exist before the tracked step
        tracker = LiveStorages()
        with tracker:
            step()
    return {"peak": tracker.peak, "peak_op": tracker.peak_op, "at_peak": tracker.at_peak}


def category(site: str) -> str:
    rules = [("grads.py", "gradient buckets (send/recv, reduced shards)"),
             ("fsdp/_fully_shard/_fsdp_collectives", "FSDP2 reduce-scatter / all-gather buffers"),
             ("gather.py", "parameter gathers"), ("partition.py", "parameter gathers"),
             ("unit.py", "parameter gathers"), ("_fsdp_param", "parameter gathers"), ("resize_", "parameter gathers"),
             ("optimizer", "optimizer step"), ("torch/optim", "optimizer step"), ("model:", "activations (forward)"),
             ("autograd", "backward temporaries (autograd)")]
    for key, name in rules:
        if key in site:
            return name
    return "other: " + site.split(" [")[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--max-reuse-distance", type=float, default=1e9,
                   help="zero3's stage3_max_reuse_distance at the GPU model's scale (default DeepSpeed's 1e9)")
    p.add_argument("--world", type=int, default=8, help="ranks of the fake process group")
    p.add_argument("--runtimes", default="zero3,fsdp2")
    p.add_argument("--runtime", help=argparse.SUPPRESS)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    if args.runtime:
        print("RESULT " + json.dumps(run(args)), flush=True)
        return 0
    mib = 2 ** 20
    results = {}
    for runtime in args.runtimes.split(","):
        cmd = [sys.executable, __file__, "--runtime", runtime, "--n-embd", str(args.n_embd), "--n-layer",
               str(args.n_layer), "--vocab", str(args.vocab), "--seq", str(args.seq), "--micro", str(args.micro),
               "--max-reuse-distance", str(args.max_reuse_distance), "--world", str(args.world)]
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            print(f"{runtime} failed:\n{proc.stderr[-3000:]}")
            return 1
        results[runtime] = json.loads(lines[-1][len("RESULT "):])
    for runtime, r in results.items():
        print(f"\n== {runtime}: peak {r['peak'] / mib:.1f} MiB above what existed before the step, "
              f"reached at {r['peak_op']}")
        cats: dict[str, int] = defaultdict(int)
        for site, n in sorted(r["at_peak"].items(), key=lambda kv: -kv[1])[: args.top]:
            if n:
                print(f"  {n / mib:8.1f} MiB  {site}")
        for site, n in r["at_peak"].items():
            cats[category(site)] += n
        print("  by category:")
        for name, n in sorted(cats.items(), key=lambda kv: -kv[1]):
            if n >= mib // 10:
                print(f"  {n / mib:8.1f} MiB  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
