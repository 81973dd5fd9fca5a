"""RTP: rotated tensor parallelism. ``model = RotatedTensorParallel(model)``; see README.md here."""

from .api import RotatedTensorParallel
from .hooks import ReplicatedLayerWarning
from .memory import StateBytes, state_bytes
from .shard import Position, RotatingShard
from .split import Split

__all__ = ["Position", "ReplicatedLayerWarning", "RotatedTensorParallel", "RotatingShard", "Split",
           "StateBytes", "state_bytes"]
