"""Device placement: which device a rank computes on, the model moved there, every buffer and collective on it.

No GPU is needed: the meta device stands in for "a device other than the CPU" (a tensor created on the CPU by
accident shows up as a CPU tensor among meta ones), and the fake process group runs the real engine on it.
"""

import pytest
import torch
import torch.nn as nn

import zero_engine
from zero_engine.checkpoint._model16 import to_host
from zero_engine.comm._init import set_nccl_error_handling_defaults
from zero_engine.device import device_for, place_module
from zero_engine.testing import fake_world
from zero_engine.testing.models import GPT, GPTConfig
from zero_engine.zero.gathered import _fingerprint
from zero_engine.zero.partition import sharded_param_of


def test_device_for_local_rank():
    assert device_for(3, 0) == torch.device("cpu")
    assert device_for(None, 0) == torch.device("cpu")
    assert device_for(1, 8) == torch.device("cuda", 1)
    assert device_for(3, 2) == torch.device("cuda", 1)  # several ranks on one GPU (gloo tests)
    with pytest.raises(ValueError, match="LOCAL_RANK=-1"):
        device_for(-1, 2)


def _is_partitioned(p):
    return sharded_param_of(p) is not None


def test_place_module_moves_a_whole_model_with_its_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert place_module(model, torch.device("meta"), _is_partitioned) == torch.device("meta")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_place_module_leaves_a_zero_init_model_where_it_was_built(caplog):
    with fake_world(2):
        with zero_engine.zero.Init():
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        assert all(_is_partitioned(p) for p in model.parameters())
        built = next(model.parameters()).device  # cpu here; this rank's GPU on a CUDA machine
        assert place_module(model, torch.device("meta"), _is_partitioned) == built
        assert {p.device for p in model.parameters()} == {built}
        assert f"partitioned by zero.Init on {built}" in caplog.text


def _record_devices(comm, seen: list):
    """Wrap the engine's communicator so that every tensor handed to a collective is recorded with its name."""
    for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"):
        original = getattr(comm, kind)

        def spy(*args, _original=original, _kind=kind, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            seen.extend((_kind, kwargs.get("name", ""), t.device.type) for t in tensors)
            return _original(*args, **kwargs)

        setattr(comm, kind, spy)


@pytest.mark.parametrize("bf16", [False, True])
def test_engine_keeps_every_buffer_and_collective_on_the_parameters_device(bf16):
    """On meta (standing in for cuda:N) a CPU tensor anywhere in a step is a buffer placed by accident; on NCCL it
    would be an error (e.g. the global grad norm all-reduced from a CPU tensor)."""
    cfg = GPTConfig()
    with torch.device("meta"):
        model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 500, "allgather_bucket_size": 500}}
    with fake_world(4):
        engine, *_ = zero_engine.initialize(model=model, config=config)
        assert engine.device == torch.device("meta")
        seen = []
        _record_devices(engine.comm, seen)
        idx = torch.zeros(1, cfg.block_size, dtype=torch.long, device="meta")
        for _ in range(2):
            engine.backward(engine(idx, idx))
            engine.step()
        kinds = {kind for kind, _, _ in seen}
        assert {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"} <= kinds
        off_device = [(kind, name, dev) for kind, name, dev in seen if dev != "meta"]
        assert off_device == []
        states = [t for s in engine.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        tensors = [*(sp.shard for sp in engine.sharded), *(sp.full for sp in engine.sharded),
                   *(sp.master for sp in engine.sharded if sp.master is not None), *states]
        assert states and {t.device.type for t in tensors} == {"meta"}


def test_fingerprint_stays_on_the_tensors_device():
    assert _fingerprint(torch.ones(300, device="meta")).device.type == "meta"
    a = torch.arange(10.0)
    assert not torch.equal(_fingerprint(a), _fingerprint(a.flip(0)))  # order-sensitive


def test_to_host_copies_never_aliases():
    t = torch.arange(4.0)
    host = to_host(t)
    t.add_(1)
    assert host.device.type == "cpu" and host.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_nccl_error_handling_defaults():
    env = {}
    assert set_nccl_error_handling_defaults(env)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert set_nccl_error_handling_defaults(env) == env  # the user's choices are kept
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert set_nccl_error_handling_defaults(env)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_nccl_path_is_always_native():
    """No gloo-style emulation on NCCL: the issuer uses the single-tensor collectives and AVG as they are."""
    from zero_engine.comm._backend import CollectiveIssuer

    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        support = CollectiveIssuer(None, backend, world_size=2).support
        assert (support.all_gather_single, support.reduce_scatter_single, support.avg) == (True, True, True)
        assert not support.reduce_scatter_by_all_to_all


def test_hf_reader_stages_reads_into_a_non_cpu_tensor(tmp_path):
    """A shard on the GPU cannot be a numpy view: reads into it go through a host staging buffer (meta stands in)."""
    safetensors = pytest.importorskip("safetensors.torch")
    from zero_engine.hf._files import _SafetensorsFile as SafetensorsFile

    path = tmp_path / "w.safetensors"
    safetensors.save_file({"w": torch.arange(10.0)}, str(path))
    f = SafetensorsFile(str(path))
    try:
        host = torch.empty(4)
        f.read_into("w", 3, 7, host)
        assert host.tolist() == [3.0, 4.0, 5.0, 6.0]
        f.read_into("w", 3, 7, torch.empty(4, device="meta"))  # no numpy() of a device tensor
    finally:
        f.close()
