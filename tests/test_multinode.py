"""Two "hosts" on this machine: network namespaces joined by a veth pair, one torchrun node in each.

The demo (examples/train_gpt.py) runs with ``torchrun --nnodes 2 --nproc_per_node 1`` and c10d rendezvous across
the two namespaces (10.231.14.1 and .2, a private /30 that exists only inside namespaces this test creates), with
GLOO_SOCKET_IFNAME naming each side's veth, so every byte between the ranks crosses the virtual link. Its losses
must equal a one-host two-rank run exactly (same ranks, same collectives, same order: bitwise). Needs root and
iproute2; otherwise skipped with the reason. The namespaces (and with them the veth pair) are removed on every path.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from session_run import run_in_session

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.231.14.{}"
PORT = 29417
DEMO_ARGS = ["examples/train_gpt.py", "--steps", "4", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--vocab",
             "128", "--block-size", "16"]
TIMEOUT = 240


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts():
    """Yield the names of two namespaces whose veth ends have addresses .1 and .2; remove them afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = uuid.uuid4().hex[:6]
    hosts = [f"ze14-{tag}-a", f"ze14-{tag}-b"]
    links = [f"ze{tag}a", f"ze{tag}b"]  # interface names: at most 15 characters
    created = []
    try:
        for ns in hosts:
            probe = _ip("netns", "add", ns, check=False)
            if probe.returncode != 0:
                pytest.skip(f"`ip netns add` failed here ({probe.stderr.strip()}): no namespaces on this machine")
            created.append(ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (ns, link) in enumerate(zip(hosts, links)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", SUBNET.format(i + 1) + "/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield list(zip(hosts, links))
    finally:
        for ns in created:  # deleting a namespace deletes the veth end inside it, and so the pair
            _ip("netns", "del", ns, check=False)
        for link in links:  # a pair left in the root namespace if moving it failed
            _ip("link", "del", link, check=False)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _demo_config(tmp_path) -> list:
    """The demo's ZeRO-3 config with torch's AdamW: this test is about the network, and a JIT build of the CPU Adam
    kernel in four processes at once would only add minutes (the kernel has its own tests)."""
    config = json.loads((ROOT / "examples" / "configs" / "zero3.json").read_text())
    config["optimizer"]["params"]["torch_adam"] = True
    path = tmp_path / "zero3_torch_adam.json"
    path.write_text(json.dumps(config))
    return ["--config", str(path)]


def test_two_nodes_over_veth_match_one_host(two_hosts, tmp_path):
    demo = [*DEMO_ARGS, *_demo_config(tmp_path)]
    one_host = tmp_path / "one_host.json"
    done = run_in_session(_torchrun("--standalone", "--nproc_per_node", "2", *demo, "--losses", str(one_host)),
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"one-host run: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"

    two_nodes = tmp_path / "two_nodes.json"
    endpoint = f"{SUBNET.format(1)}:{PORT}"
    procs = []
    for node_rank, (ns, link) in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns,
               *_torchrun("--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
                          "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", f"ze14-{tmp_path.name}",
                          "--local_addr", SUBNET.format(node_rank + 1), "--max_restarts", "0",
                          # torchrun decides who hosts the rendezvous store by resolving this machine's hostname,
                          # which names the same (root-namespace) address in both namespaces: say it explicitly
                          "--rdzv_conf", f"is_host={int(node_rank == 0)},join_timeout=120",
                          *demo, "--losses", str(two_nodes))]
        # the host part of the node's address resolves to nothing useful inside a namespace: name the interface
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(GLOO_SOCKET_IFNAME=link), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    assert "on 2 ranks" in outputs[0]
    expected, got = json.loads(one_host.read_text()), json.loads(two_nodes.read_text())
    assert len(got) == 4 and got == expected  # bitwise: the same collectives in the same order
