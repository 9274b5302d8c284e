"""On paper (issue 24): cross-node bytes and a modelled step time for flat ZeRO-3, MiCS (within a node; over 4 nodes,
with and without the two-step gather), hpZ and hpZ + qwZ + qgZ at 64 nodes x 8 GPUs.

    python bench/hierarchy_sim.py                          # LLaMA-7B shape, 64 x 8, MiCS 8 and hpZ 8, 100 Gb/s
    python bench/hierarchy_sim.py --nodes 8 --inter-gbps 400 --json out.json

Bytes are the engine's own: one steady training step (bf16, fp32 masters, AdamW) of the real engine on the meta
LLaMA-7B of scale_sim.py, as one rank of the fake process group, and ``engine.comm_stats(by_group=True)`` (per rank:
all-gather = output bytes, reduce-scatter = input bytes, all-reduce = the tensor). Everything else is a model, with
these assumptions:

* ranks are numbered node by node (rank = node * gpus_per_node + local rank), so the world group spans every node,
  MiCS's ``dp_shard`` and hpZ's ``hpz`` groups (of gpus_per_node consecutive ranks) stay within a node and MiCS's
  ``dp_replicate`` groups (one rank per node) span every node, gpus_per_node of them side by side;
* ring collectives, bandwidth term only (no latency, no contention model): in a group of n ranks a rank moves
  (n - 1) / n of its all-gather / reduce-scatter / all-to-all bytes and 2 (n - 1) / n of its all-reduce bytes (an
  all-to-all is no ring, but over a node-spanning group it sends the same (n - 1) / n across); with the ring
  ordered by node, a node's inter-node link carries that volume once per group of this node (so a node-spanning
  group with r ranks per node costs the node gpus_per_node / r times one rank's volume);
* one inter-node link per node (``--inter-gbps``, one direction) shared by its GPUs; inside a node, each GPU moves
  its intra-node volume at ``--intra-gbs`` GB/s; the two are added, no overlap between groups or with compute;
* compute: 6 x parameters x tokens x gas FLOPs per rank at ``--tflops`` effective; the step is bounded below by
  max(compute, communication) (perfect overlap) and above by their sum (none).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zero_engine  # noqa: E402
from scale_sim import llama_7b_on_meta, model_vocab  # noqa: E402
from zero_engine.testing import fake_world  # noqa: E402

LAYOUTS = {"flat ZeRO-3": {}, "MiCS 8": {"mics_shard_size": 8}, "hpZ 8": {"zero_hpz_partition_size": 8},
           "hpZ 8 + qwZ + qgZ": {"zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                                 "zero_quantized_gradients": True}}


def spanning_mics(nodes: int, gpus_per_node: int) -> dict:
    """MiCS with shard groups over up to 4 whole nodes, without and with the two-step gather (zero/mics.py)."""
    span = min(4, nodes)
    k = span * gpus_per_node
    return {f"MiCS {k} ({span} nodes)": {"mics_shard_size": k},
            f"MiCS {k}, two-step gather": {"mics_shard_size": k, "mics_hierarchical_params_gather": True}}
# all-to-all (qgZ): a rank keeps 1 / n of what it sends, as a ring all-gather / reduce-scatter keeps 1 / n
RING = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}


def engine_step_bytes(world: int, rank: int, zero: dict, gas: int = 1) -> tuple[dict, dict, dict]:
    """(comm_stats(by_group=True), each group's ranks, memory_stats()) of one steady step (``gas`` micro-steps) as
    ``rank`` of ``world``."""
    model = llama_7b_on_meta()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, **zero}}
    with fake_world(world, rank=rank):
        engine, *_ = zero_engine.initialize(model=model, config=config)
        idx = torch.zeros(1, 8, dtype=torch.long, device="meta")
        for _ in range(2):  # the second step follows the recorded trace; count that one
            engine.reset_comm_stats()
            for _ in range(gas):
                loss = engine(idx % model_vocab(model), idx)
                engine.backward(loss)
                engine.step()
        stats = engine.comm_stats(by_group=True)
        ranks = {name: torch.distributed.get_process_group_ranks(comm.group)
                 for name, comm in engine.communicators().items()}
        memory = engine.memory_stats()
        engine.destroy()
    return stats, ranks, memory


def model_layout(stats: dict, ranks: dict, gpus_per_node: int, args) -> dict:
    inter = intra = 0.0  # bytes: over this node's inter-node link; moved by one GPU within its node
    for group, kinds in stats.items():
        n = len(ranks[group])
        per_rank = sum(RING[kind](n) * v["bytes"] for kind, v in kinds.items() if kind in RING and n > 1)
        nodes = {r // gpus_per_node for r in ranks[group]}
        if len(nodes) > 1:  # this node's link carries the ring's volume once per such group with ranks here
            inter += per_rank * gpus_per_node / (n // len(nodes))
        else:
            intra += per_rank
    comm_s = inter / (args.inter_gbps * 1e9 / 8) + intra / (args.intra_gbs * 1e9)
    return {"inter_node_bytes": inter, "intra_node_bytes_per_gpu": intra, "comm_s": comm_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--inter-gbps", type=float, default=100.0, help="inter-node link per node, Gbit/s")
    parser.add_argument("--intra-gbs", type=float, default=150.0, help="intra-node bandwidth per GPU, GByte/s")
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps (micro-steps per step)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank per micro-step (compute model)")
    parser.add_argument("--tflops", type=float, default=150.0, help="effective TFLOP/s per GPU (compute model)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    g = args.gpus_per_node
    os.environ["LOCAL_WORLD_SIZE"] = str(g)  # the node the two-step gather (mics_hierarchical_params_gather) splits
    world = args.nodes * g
    rank = g + 1  # node 1, local rank 1: every group is like every other's
    n_params = sum(p.numel() for p in llama_7b_on_meta().parameters())
    compute_s = 6 * n_params * args.tokens * args.gas / (args.tflops * 1e12)
    rows = []
    for name, zero in (LAYOUTS | spanning_mics(args.nodes, g)).items():
        stats, ranks, memory = engine_step_bytes(world, rank, zero, args.gas)
        row = {"layout": name, "zero": zero, "group_sizes": {k: len(v) for k, v in ranks.items()},
               "comm_stats": stats,
               "params_per_rank": memory["params_sharded"] + memory.get("params_secondary", 0),
               **model_layout(stats, ranks, g, args)}
        row["step_s_overlap"] = max(compute_s, row["comm_s"])
        row["step_s_serial"] = compute_s + row["comm_s"]
        rows.append(row)
    flat = rows[0]
    print(f"LLaMA-7B shape ({n_params:,} parameters), bf16 (fp32 gradient reduction), {args.nodes} nodes x {g} GPUs,"
          f" inter-node {args.inter_gbps:g} Gb/s per node, intra-node {args.intra_gbs:g} GB/s per GPU, compute "
          f"{compute_s:.3f} s ({args.gas} x {args.tokens} tokens/rank at {args.tflops:g} TFLOP/s)\n")
    print("| layout | per-group bytes per rank (engine, one step) | inter-node GB per node | x flat "
          "| intra-node GB per GPU | comm s | step s (overlap - serial) | x flat |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        groups = "; ".join(f"{grp} ({r['group_sizes'][grp]}): " + ", ".join(
            f"{k} {v['bytes'] / 1e9:.2f} GB" for k, v in kinds.items() if v["bytes"]) for grp, kinds in
            r["comm_stats"].items() if any(v["bytes"] for v in kinds.values()))
        print(f"| {r['layout']} | {groups} | {r['inter_node_bytes'] / 1e9:.2f} | "
              f"{r['inter_node_bytes'] / flat['inter_node_bytes']:.2f} | {r['intra_node_bytes_per_gpu'] / 1e9:.2f} | "
              f"{r['comm_s']:.2f} | {r['step_s_overlap']:.2f} - {r['step_s_serial']:.2f} | "
              f"{r['step_s_serial'] / flat['step_s_serial']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
