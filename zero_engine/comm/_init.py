"""init_distributed: start torch.distributed from torchrun's environment or explicit arguments."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from ..device import device_for

logger = logging.getLogger(__name__)


def _env_int(key: str) -> Optional[int]:
    value = os.environ.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


# torch's default for a gloo group, and DeepSpeed's init_distributed default: 30 minutes.
DEFAULT_TIMEOUT_S = 1800.0


def group_timeout_s(group=None) -> float:
    """The collective timeout the process group was created with (``init_process_group(timeout=...)``), in seconds.

    torch has no public getter: it is the backend's ``options._timeout`` (gloo's and NCCL's alike);
    ``DEFAULT_TIMEOUT_S`` for a group whose backend does not say (a fake or third-party backend)."""
    group = group if group is not None else dist.group.WORLD
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 -- no backend for this device, or one without options
            continue
    return DEFAULT_TIMEOUT_S


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# [Note: NCCL errors and timeouts]
# NCCL collectives run asynchronously on the GPU; a peer that died or diverged leaves them pending forever unless
# something watches them. ProcessGroupNCCL's watchdog thread does: with TORCH_NCCL_ASYNC_ERROR_HANDLING=3 it aborts
# the communicators of a collective that failed or ran past the process group's ``timeout`` (``timeout_s`` here,
# zero_engine.collective_timeout_s from the engine) and raises in the training thread instead of hanging or killing
# the process without a message (1 tears the process down; 3 is torch's default since 2.2, stated here so that an
# older default or an inherited 0 cannot silently disable it). TORCH_NCCL_DUMP_ON_TIMEOUT writes the flight recorder
# on a timeout, which names the collective each rank was in. Values the user set are kept.
NCCL_ERROR_HANDLING_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def set_nccl_error_handling_defaults(environ=None) -> dict:
    """Set [Note: NCCL errors and timeouts]'s variables where unset (before the NCCL group exists); returns them.

    An inherited ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (errors ignored: a lost rank hangs the job) is overridden
    with a warning: the engine relies on the abort to turn a stall into an error."""
    environ = os.environ if environ is None else environ
    for key, value in NCCL_ERROR_HANDLING_DEFAULTS.items():
        if environ.get(key, "") == "":
            environ[key] = value
    if environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        logger.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=0 would let a failed or timed-out NCCL collective hang the "
                       "job; using 3 (abort the communicators and raise)")
        environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    return {key: environ[key] for key in NCCL_ERROR_HANDLING_DEFAULTS}


def init_distributed(backend: Optional[str] = None, init_method: Optional[str] = None, rank: Optional[int] = None,
                     world_size: Optional[int] = None, timeout_s: Optional[float] = None, *,
                     dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, dist_init_required: Optional[bool] = None,
                     config=None) -> None:
    """Initialize the default process group once; later calls (or a group someone else made) are a quiet no-op.

    DeepSpeed's keywords are accepted too (``deepspeed.init_distributed(dist_backend="gloo")`` works unchanged):
    ``dist_backend`` is ``backend``, ``timeout`` (a timedelta) is ``timeout_s``, ``rank``/``world_size`` of -1 mean
    "from the environment", ``distributed_port`` is the rendezvous port when ``MASTER_ADDR`` is set without
    ``MASTER_PORT``, ``dist_init_required=False`` makes the call a no-op, ``verbose=False`` logs at debug level.
    MPI discovery (``auto_mpi_discovery`` with an MPI launcher's environment and no ``RANK``) and ``config`` (a
    comms-logger config) are refused: launch with torchrun or set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

    Where each value comes from, first match wins:

    * ``rank`` / ``world_size``: the arguments, then torchrun's ``RANK`` / ``WORLD_SIZE``; with neither, a
      single-process group (rank 0 of 1), so ``python train.py`` works without a launcher.
    * ``init_method``: the argument, then ``env://`` when ``MASTER_ADDR`` and ``MASTER_PORT`` are set; a
      single-process group without them rendezvous on a free local port. More than one rank without either is an
      error (the ranks would have no way to find each other).
    * ``backend``: the argument, else "nccl" when CUDA is available and "gloo" otherwise.
    * the CUDA device (when CUDA is available): ``LOCAL_RANK`` (else the rank) modulo the local device count; see
      zero_engine.device. With NCCL the group is bound to it (``device_id``) and NCCL's asynchronous error handling
      is on (see [Note: NCCL errors and timeouts]).

    ``timeout_s`` bounds how long a collective may wait for its peers before the backend gives up (a hung rank then
    becomes an error rather than a silent stall); raise it for very slow first steps (e.g. compilation). None:
    ``DEFAULT_TIMEOUT_S`` (30 minutes, as torch and DeepSpeed).
    """
    if dist_init_required is False:
        return
    if dist_backend is not None:
        if backend is not None and backend != dist_backend:
            raise ValueError(f"init_distributed: backend={backend!r} and dist_backend={dist_backend!r} disagree; "
                             "give one")
        backend = dist_backend
    if timeout is not None:
        timeout_s = timeout.total_seconds()
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    rank = None if rank == -1 else rank
    world_size = None if world_size == -1 else world_size
    if config is not None:
        raise NotImplementedError("init_distributed(config=...): DeepSpeed's comms-logger config is not supported "
                                  "by zero_engine; drop the argument (engine.comm_stats() counts collectives)")
    if auto_mpi_discovery and rank is None and _env_int("RANK") is None and os.environ.get("OMPI_COMM_WORLD_SIZE"):
        raise NotImplementedError("init_distributed: MPI discovery (an mpirun launch without RANK/WORLD_SIZE) is "
                                  "not supported by zero_engine; launch with torchrun, or set RANK, WORLD_SIZE, "
                                  "LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    if distributed_port is not None and os.environ.get("MASTER_ADDR") and not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(distributed_port)
    if dist.is_initialized():
        logger.debug("init_distributed: a process group already exists (rank %d of %d); nothing to do",
                     dist.get_rank(), dist.get_world_size())
        return
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support; install a build with distributed")
    if timeout_s <= 0:
        raise ValueError(f"init_distributed: timeout_s={timeout_s} must be positive (seconds)")

    rank = rank if rank is not None else _env_int("RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    if rank is None and world_size is None:
        rank, world_size = 0, 1
        logger.info("init_distributed: no RANK/WORLD_SIZE in the environment; starting a single-process group")
    elif rank is None or world_size is None:
        raise ValueError(
            f"init_distributed: got rank={rank} and world_size={world_size}; give both (as arguments or as the "
            "RANK and WORLD_SIZE environment variables torchrun sets), or neither for a single process"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: rank={rank} is not in 0..world_size-1 (world_size={world_size})")

    if init_method is None:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            init_method = "env://"
        elif world_size == 1:
            init_method = f"tcp://127.0.0.1:{_free_local_port()}"
        else:
            raise ValueError(
                f"init_distributed: world_size={world_size} needs a rendezvous: set MASTER_ADDR and MASTER_PORT "
                "(torchrun does), or pass init_method='tcp://host:port' or 'file:///shared/path'"
            )

    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if "nccl" in backend and not cuda:
        raise ValueError("init_distributed: backend='nccl' needs CUDA, which is not available; use backend='gloo'")

    extra = {}
    if cuda:
        local_rank = _env_int("LOCAL_RANK")
        device = device_for(local_rank if local_rank is not None else rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
        if "nccl" in backend:
            set_nccl_error_handling_defaults()
            extra["device_id"] = device  # binds the group to this GPU: eager NCCL init, no guessing of the device

    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **extra)
    logger.log(logging.INFO if verbose else logging.DEBUG, "rank %d: initialized torch.distributed (backend %s, world size %d, init %s, timeout %.0fs)",
                rank, backend, world_size, init_method.split("?")[0], timeout_s)
