"""RTP: rotated tensor parallelism. ``model = RotatedTensorParallel(model)``; see README.md here."""

from .api import RotatedTensorParallel
from .hooks import ReplicatedLayerWarning
from .state_bytes import StateBytes, state_bytes
from .shard import Position, RotatingShard
from .split import Split
from .teardown import destroy_process_group

__all__ = ["Position", "ReplicatedLayerWarning", "RotatedTensorParallel", "RotatingShard", "Split",
           "StateBytes", "destroy_process_group", "state_bytes"]
