"""Where each partitioned state lives: on the compute device, in host memory, or in files on NVMe.

One ``Placement`` per engine, decided once from the config (``zero_optimization.offload_optimizer`` and
``offload_param``) and the rank's compute device, logged once at start-up, and read by the optimizer, the gradient
reducer and ``engine.memory_stats()``. Four categories, as the ZeRO papers count model states:

============== ============================== =====================================================================
category       memory_stats() key             placed by
============== ============================== =====================================================================
compute shard  ``params_sharded``             ``offload_param.device`` (stage 3): device / host / nvme
fp32 masters   ``master_params``              ``offload_optimizer.device``: device / host / nvme
optimizer      ``optimizer_states``           ``offload_optimizer.device``: device / host / nvme
gradient shard ``grads``                      ``offload_optimizer.device``: host for cpu and nvme (the step runs
                                              on the host), else device
============== ============================== =====================================================================

[Note: host and device on a CPU-only machine]
Without an accelerator the compute device *is* host memory: ``offload_optimizer: {device: cpu}`` asks for what
already happens, so nothing is copied (the masters stay the compute shards in fp32 training, gradient shards stay
where the reduce-scatter wrote them) and the log says so once. The copies of the CUDA path (device->host gradient
shards per reduced bucket, host->device compute shard after the step) run only when ``has_separate_host`` is true.
``memory_stats()["by_location"]`` still reports the configured location ("host"), which is the truth either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["DEVICE", "HOST", "NVME", "LOCATIONS", "Placement"]

log = logging.getLogger("zero_engine.offload")

DEVICE, HOST, NVME = "device", "host", "nvme"
LOCATIONS = (DEVICE, HOST, NVME)
_FROM_CONFIG = {"none": DEVICE, "cpu": HOST, "nvme": NVME}


@dataclass(frozen=True)
class Placement:
    """Where this rank keeps each category of model state; see the module docstring."""

    device: torch.device  # the compute device of this rank
    params: str = DEVICE  # 16-bit (compute dtype) parameter shards
    masters: str = DEVICE  # fp32 master shards (the compute shards themselves in fp32 training, when on device)
    optimizer_states: str = DEVICE  # Adam moments (or SGD momentum)
    grads: str = DEVICE  # reduced gradient shards the step reads
    pin_memory: bool = False  # page-locked host buffers (only meaningful with an accelerator)
    nvme_path: str | None = None  # offload_optimizer.nvme_path when masters / states are on nvme
    param_nvme_path: str | None = None  # offload_param.nvme_path when the compute shards are on nvme
    param_pin_memory: bool = False  # offload_param.pin_memory: the host parameter shards page-locked

    @classmethod
    def from_config(cls, zc, device: torch.device) -> "Placement":
        """From a ``ZeroConfig`` (``cfg.zero_optimization``) and the rank's compute device."""
        opt, par = zc.offload_optimizer, zc.offload_param
        if opt is not None and (opt.ratio != 1.0 or opt.super_offload):  # refused by the config (NotSupported)
            raise AssertionError(f"offload_optimizer ratio={opt.ratio}, super_offload={opt.super_offload} reached the "
                                 "engine; only ratio 1.0 without SuperOffload is implemented")
        return cls.of(zc.stage, opt.device if opt is not None else "none", par.device if par is not None else "none",
                      device, pin_memory=bool(opt is not None and opt.pin_memory),
                      nvme_path=opt.nvme_path if opt is not None else None,
                      param_nvme_path=par.nvme_path if par is not None else None,
                      param_pin_memory=bool(par is not None and par.pin_memory))

    @classmethod
    def of(cls, stage: int, offload_optimizer: str = "none", offload_param: str = "none",
           device: torch.device | str = "cpu", pin_memory: bool = False, nvme_path: str | None = None,
           param_nvme_path: str | None = None, param_pin_memory: bool = False) -> "Placement":
        """From the two offload devices as the config spells them ("none", "cpu", "nvme"); the estimator's way in.
        ``offload_param`` acts at stage 3 only (as in DeepSpeed)."""
        states = _FROM_CONFIG[offload_optimizer]
        params = _FROM_CONFIG[offload_param] if stage == 3 else DEVICE
        return cls(device=torch.device(device), params=params, masters=states, optimizer_states=states,
                   grads=HOST if states != DEVICE else DEVICE, pin_memory=pin_memory and states != DEVICE,
                   nvme_path=nvme_path if states == NVME else None,
                   param_nvme_path=param_nvme_path if params == NVME else None,
                   param_pin_memory=param_pin_memory and params == HOST)

    # ---- questions the runtime asks ---------------------------------------------------------------------------
    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer_states != DEVICE

    @property
    def swaps_optimizer(self) -> bool:
        """Masters and optimizer states live in NVMe files and are streamed through host buffers by the step."""
        return self.optimizer_states == NVME

    @property
    def has_separate_host(self) -> bool:
        """Host memory is not the compute device's memory (an accelerator): offloading means copying."""
        return self.device.type not in ("cpu", "meta")

    @property
    def host_device(self) -> torch.device:
        """Where the optimizer's host-side tensors go: the CPU (or meta for shape-only runs)."""
        return self.device if self.device.type == "meta" else torch.device("cpu")

    @property
    def optimizer_device(self) -> torch.device:
        """Where masters, optimizer states and the gradient shards the step reads are allocated."""
        return self.host_device if self.offloads_optimizer else self.device

    @property
    def pins(self) -> bool:
        """Host buffers are page-locked: asked for, and an accelerator is there to make it worth it."""
        return self.pin_memory and self.has_separate_host and torch.cuda.is_available()

    @property
    def pins_params(self) -> bool:
        """The host parameter shards of ``offload_param: {device: cpu}`` are page-locked (offload/param_host.py)."""
        return self.param_pin_memory and self.has_separate_host and torch.cuda.is_available()

    # ---- reporting --------------------------------------------------------------------------------------------
    def describe(self) -> str:
        parts = [f"compute shards: {self.params}", f"fp32 masters: {self.masters}",
                 f"optimizer states: {self.optimizer_states}", f"gradient shards: {self.grads}"]
        text = f"placement on {self.device}: " + ", ".join(parts)
        if self.nvme_path:
            text += f" (nvme_path {self.nvme_path})"
        if self.param_nvme_path:
            text += f" (parameter shards under {self.param_nvme_path})"
        if self.pin_memory:
            text += ", pinned host buffers" if self.pins else ", pin_memory ignored (no accelerator)"
        if self.param_pin_memory:
            text += ", pinned parameter shards" if self.pins_params else \
                ", offload_param.pin_memory ignored (no accelerator)"
        return text

    def log_once(self, rank: int) -> None:
        """One line at start-up on rank 0; on a CPU-only machine a second one saying what "host" means here."""
        if rank != 0:
            return
        log.info("zero_engine: %s", self.describe())
        if self.params != DEVICE and not self.has_separate_host:
            if self.params == HOST:
                log.info("zero_engine: offload_param device cpu: parameters already live in host memory on this "
                         "CPU-only run (the compute device is the host; nothing is copied)")
            else:
                log.info("zero_engine: offload_param.device=nvme: the parameter shards live in files under %s and "
                         "are read ahead of their all-gathers (zero_engine/offload/param_swap.py)",
                         self.param_nvme_path)
        if self.offloads_optimizer and not self.has_separate_host:
            if self.optimizer_states == HOST:
                log.info("zero_engine: offload_optimizer.device=cpu on a CPU-only machine: the fp32 masters, optimizer "
                         "states and gradient shards already live in host memory; nothing is copied (see [Note: "
                         "host and device on a CPU-only machine] in zero_engine/offload/placement.py)")
            else:
                log.info("zero_engine: offload_optimizer.device=nvme on a CPU-only machine: host and device memory "
                         "are one here; masters and moments live in files under %s and the step streams them "
                         "through host buffers", self.nvme_path)

    def by_location(self, stats: dict[str, int], nvme_bytes: int = 0, swap_buffer_bytes: int = 0) -> dict:
        """``memory_stats()["by_location"]``: the model-state categories of ``stats`` split by where they live.

        ``{"device": {...}, "host": {...}, "nvme": {...}}``, each with ``params_sharded``, ``master_params``,
        ``grads`` (the gradient shards at their peak in the accumulation window, ``grads_peak``, as
        ``model_state_bytes`` counts them) and ``optimizer_states`` (0 where a category lives elsewhere) and
        ``total``. Under NVMe offload the
        masters and states are counted under "nvme" (``files``: the files' size on disk, 0 without NVMe), and the
        host buffers the step streams them through under "host" as ``swap_buffers``.
        """
        out = {loc: {"params_sharded": 0, "master_params": 0, "grads": 0, "optimizer_states": 0}
               for loc in LOCATIONS}
        for category, location in (("params_sharded", self.params), ("master_params", self.masters),
                                   ("grads", self.grads), ("optimizer_states", self.optimizer_states)):
            key = "grads_peak" if category == "grads" and "grads_peak" in stats else category
            out[location][category] += int(stats.get(key, 0))
        out[HOST]["swap_buffers"] = swap_buffer_bytes
        out[NVME]["files"] = nvme_bytes
        for entry in out.values():
            entry["total"] = sum(v for k, v in entry.items() if k not in ("total", "files"))
        return out
