"""The demo's models and how a served batch becomes (inputs, labels).

Image datasets arrive as {"image": uint8 [B, C, H, W], "label": [B]} and train a small
CNN; table datasets arrive as columns and train an MLP over their numeric columns. Both
use only layers RTP shards (Conv2d, Linear, LayerNorm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a 4x4 pooled grid, two linear layers: ~150k weights."""

    def __init__(self, channels: int, num_classes: int, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),  # any image size ends as a 4x4 grid
            nn.Flatten(),
        )
        self.head = nn.Sequential(
            nn.Linear(2 * width * 16, 128),
            nn.LayerNorm(128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class SmallMLP(nn.Module):
    def __init__(self, features: int, num_classes: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.LayerNorm(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(example: torch.Tensor, num_classes: int) -> nn.Module:
    """A CNN for image batches [B, C, H, W], an MLP for feature batches [B, F]."""
    if example.dim() == 4:
        return SmallCNN(example.shape[1], num_classes)
    if example.dim() == 2:
        return SmallMLP(example.shape[1], num_classes)
    raise ValueError(f"expected image batches [B, C, H, W] or feature batches [B, F], got shape {tuple(example.shape)}")


def _scaled(t: torch.Tensor) -> torch.Tensor:
    # Pixels scaled to [-1, 1]; other numbers are left to the first LayerNorm.
    return t.float() / 127.5 - 1.0 if t.dtype == torch.uint8 else t.float()


def _numeric(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.dtype in _INTEGER)


_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def batch_inputs(data: dict[str, Any], label_column: str = "label",
                 feature_columns: Sequence[str] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs float, labels int64) from a collated batch of an image or a table dataset."""
    if label_column not in data:
        raise KeyError(f"the batch has no label column {label_column!r}; columns: {sorted(data)}")
    labels = torch.as_tensor(data[label_column]).long()
    if "image" in data and not feature_columns:
        return _scaled(data["image"]), labels
    names = list(feature_columns) or [k for k, v in data.items() if k != label_column and _numeric(v)]
    if not names:
        raise ValueError(f"no numeric feature columns besides {label_column!r}; columns: {sorted(data)}")
    parts = [_scaled(data[k]).reshape(len(labels), -1) for k in names]
    return torch.cat(parts, dim=1), labels
