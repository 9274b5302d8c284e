"""Checkpoints: atomic sharded save and load (at any world size), and offline consolidation to fp32.

    engine.save_checkpoint("ckpt", client_state={"epoch": 3})          # collective; ckpt/global_step<N>/ + latest
    path, client_state = engine.load_checkpoint("ckpt")                # collective; any world size
    engine.save_16bit_model("export")                                  # collective; rank 0 writes a state dict

    # offline, no ranks:
    state_dict = zero_engine.checkpoint.get_fp32_state_dict_from_zero_checkpoint("ckpt")
    $ zero-engine to-fp32 ckpt model.safetensors

    # to and from torch.distributed.checkpoint (FSDP2, torchtitan), offline (dcp.py):
    zero_engine.checkpoint.from_dcp("fsdp2_ckpt", "ckpt", config="ds_config.json")
    zero_engine.checkpoint.to_dcp("ckpt", "fsdp2_ckpt")
    $ zero-engine convert fsdp2_ckpt ckpt --config ds_config.json

Format: our own (see [Note: why our own format] below), one safetensors-layout file per rank plus a JSON metadata
file that lists every parameter's partitioning and every file's size and SHA-256; _metadata.py shows the layout.

[Note: why our own format rather than torch.distributed.checkpoint]
DCP would reshard for us if every shard were a DTensor; our shards are flat per-parameter slices padded to
ceil(numel / world), which is DTensor's Shard(0) of the flattened parameter, so it could be expressed. We still
write our own because:
- resharding a flat 1-D partition is a few lines of interval arithmetic (_partition.py), while wrapping every
  parameter and optimizer-state shard as a DTensor on a DeviceMesh means building that machinery (and its
  uneven-shard corner cases) just to save, and running DCP's planner (a gather of plans) for what is a fixed layout;
- the guarantees the issue asks for are not DCP's: it writes files in place (no staging directory, no fsync, no
  atomic rename, no `latest`) and keeps no checksums, so we would wrap it in our own atomicity and verification;
- the offline tools must work without torch.distributed and stream one parameter at a time; our files are read by
  byte range, so consolidation reads exactly each parameter's bytes, and the files need no pickle (the safetensors
  package can read them too);
- non-tensor state (RNG states, loss scaler, scheduler, client_state, gradient-accumulation mode) fits plainly.
"""

from ._consolidate import (ConversionResult, convert_zero_checkpoint_to_fp32_state_dict,
                           get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint,
                           verify_checkpoint)
from ._errors import CheckpointError
from ._load import load_checkpoint
from ._model16 import save_16bit_model
from ._save import save_checkpoint
from .dcp import from_dcp, to_dcp

__all__ = ["save_checkpoint", "load_checkpoint", "save_16bit_model", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "verify_checkpoint", "ConversionResult", "CheckpointError", "from_dcp", "to_dcp"]
