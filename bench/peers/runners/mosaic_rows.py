"""The Mosaic runner's dataset class, at module level so spawned DataLoader workers can unpickle it.

Importing it imports `streaming` (with the torchvision placeholder where needed: see
_common.torchvision_or_placeholder); NOTE holds what that said, "" if nothing was replaced.
"""

from __future__ import annotations

from _common import decode_jpeg, torchvision_or_placeholder

NOTE = torchvision_or_placeholder()

import torch  # noqa: E402
from streaming import StreamingDataset  # noqa: E402


class Rows(StreamingDataset):
    """StreamingDataset whose samples are decoded like croupier's (uint8 CHW images, int32 tokens)."""

    def __init__(self, *, image: bool, **kw):
        super().__init__(**kw)
        self.image = image

    def get_item(self, idx: int):
        row = super().get_item(idx)
        if self.image:
            return {"id": row["id"], "label": row["label"], "image": decode_jpeg(row["jpg"])}
        return {"id": row["id"], "label": row["label"], "text": row["text"],
                "tokens": torch.from_numpy(row["tokens"].copy())}
