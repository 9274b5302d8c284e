"""bench/hierarchy_sim.py at 2 nodes x 8 ranks (the docs' figures are 64 x 8): the per-group bytes it reads from the
engine and the inter-node volumes its model derives from them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

_PATH = Path(__file__).resolve().parents[1] / "bench" / "hierarchy_sim.py"
_spec = importlib.util.spec_from_file_location("bench_hierarchy_sim", _PATH)
hierarchy_sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = hierarchy_sim
_spec.loader.exec_module(hierarchy_sim)


def test_inter_node_bytes_flat_mics_hpz(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert hierarchy_sim.main(["--nodes", "2", "--json", str(out)]) == 0
    assert "| hpZ 8 |" in capsys.readouterr().out
    flat, mics, hpz, zpp, spanning, two_step = json.loads(out.read_text())["rows"]
    assert (flat["layout"], mics["layout"], hpz["layout"]) == ("flat ZeRO-3", "MiCS 8", "hpZ 8")
    world = flat["comm_stats"]["world"]
    # flat: everything crosses nodes (one ring of 16, half its hops inter-node), nothing stays inside one
    ring = 15 / 16
    assert flat["inter_node_bytes"] == pytest.approx(ring * sum(world[k]["bytes"] for k in world if k != "all_reduce")
                                                     + 2 * ring * world["all_reduce"]["bytes"])
    assert flat["intra_node_bytes_per_gpu"] == 0
    # MiCS: only the replicas' all-reduce of the gradient shard crosses, 8 rings (one per local rank) of 2 nodes
    assert mics["comm_stats"]["dp_replicate"]["all_reduce"]["bytes"] == \
        mics["comm_stats"]["dp_shard"]["reduce_scatter"]["bytes"] // 8
    assert mics["comm_stats"]["world"]["all_gather"]["bytes"] == 0
    # hpZ: the backward all-gather moves into the node, so fewer bytes cross it
    assert hpz["comm_stats"]["hpz"]["all_gather"]["bytes"] > 0
    assert hpz["inter_node_bytes"] < 0.8 * flat["inter_node_bytes"]
    # hpZ + qwZ + qgZ: the forward all-gather in int8 (about half) and the gradients as an int4 all-to-all (about an
    # eighth of the fp32 reduce-scatter) cross the nodes
    world_q = zpp["comm_stats"]["world"]
    assert world_q["reduce_scatter"]["bytes"] == 0 and world_q["all_to_all"]["bytes"] > 0
    assert world_q["all_to_all"]["bytes"] < 0.14 * world["reduce_scatter"]["bytes"]
    assert world_q["all_gather"]["bytes"] < 0.55 * hpz["comm_stats"]["world"]["all_gather"]["bytes"]
    assert zpp["inter_node_bytes"] < 0.3 * hpz["inter_node_bytes"]
    # MiCS over both nodes (16), then with the two-step gather: the rings of its first step (2 ranks, one per node)
    # carry 1/8 of the flat gather's bytes each, 8 of them per node, so 8 x 1/2 of a chunk per chunk of the flat ring's
    # 15/16: the node's all-gather bytes drop to 8/15 of the flat gather's
    assert (spanning["layout"], two_step["layout"]) == ("MiCS 16 (2 nodes)", "MiCS 16, two-step gather")
    flat_ag = spanning["comm_stats"]["world"]["all_gather"]["bytes"]  # a shard group of the whole world: flat
    assert two_step["comm_stats"]["world"]["all_gather"]["bytes"] == 0
    assert two_step["comm_stats"]["gather_inter"]["all_gather"]["bytes"] * 8 == flat_ag
    assert two_step["comm_stats"]["gather_intra"]["all_gather"]["bytes"] == flat_ag
    assert spanning["inter_node_bytes"] - two_step["inter_node_bytes"] == pytest.approx(flat_ag * (15 / 16 - 8 / 16))
