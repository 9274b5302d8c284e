"""torch.distributed wrappers: start-up from torchrun's environment, counted collectives, debug consistency checks.

    from zero_engine.comm import init_distributed, Communicator
    init_distributed()                      # torchrun env, or a single process; nccl on GPU, gloo on CPU
    comm = Communicator(debug=False)
    comm.all_gather_into_tensor(full, shard, async_op=True, name="blocks.0").wait()
    comm.stats()                            # {"all_gather": {"calls": 1, "bytes": ...}, ...}

It also has ``deepspeed.comm``'s functions (``get_rank``, ``get_world_size``, ``get_local_rank``, ``barrier``,
``all_reduce``, ...: torch.distributed's, see _deepspeed.py), so ``import zero_engine as deepspeed`` finds them
under ``deepspeed.comm``.
"""

# Imported before any process group exists: torch.distributed.nn.functional's collectives take ``group=group.WORLD``
# as a default argument, evaluated on first import, and the first torch optimizer imports it (through torch._dynamo);
# imported after init_process_group, it would hold the world group for good. See [Note: clean shutdown].
import torch.distributed.nn  # noqa: F401

from zero_engine.comm import _deepspeed
from zero_engine.comm._communicator import Communicator, Pending
from zero_engine.comm._consistency import CollectiveMismatchError
from zero_engine.comm._deepspeed import *  # noqa: F401,F403  deepspeed.comm's functions (get_rank, barrier, ...)
from zero_engine.comm._init import init_distributed
from zero_engine.comm.liveness import post_failure

__all__ = ["init_distributed", "Communicator", "Pending", "CollectiveMismatchError", "post_failure"] + _deepspeed.__all__
