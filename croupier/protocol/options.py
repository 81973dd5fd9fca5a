"""The options that travel: one type shared by the CLI, the server and the client.

`StreamOptions` is what a trainer asks the server for; it converts to and from the
`StreamEpochRequest` proto here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from croupier.protocol.epoch_plan import PlanStart
from croupier.v1 import croupier_pb2 as pb


@dataclass(frozen=True)
class StreamOptions:
    """One rank's stream of one epoch (the semantics: docs/DESIGN.md section 4, "Guarantees")."""

    dataset: str
    batch_size: int
    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    start_batch: int = 0
    #: Stop before this batch; 0 streams to the end of the epoch.
    end_batch: int = 0
    #: Fetch one sample at a time in plan order (the ablation) instead of all at once.
    ordered: bool = False
    #: Batches read ahead of the current one; 0 lets the server choose. The server
    #: clamps larger values to its `--max-prefetch`.
    prefetch: int = 0
    #: Table columns to send; empty sends all.
    columns: tuple[str, ...] = field(default_factory=tuple)
    #: Decode images on the server (raw HWC uint8) instead of on the trainer.
    decode_images: bool = False
    #: Where in the epoch's permutation the plan begins (an elastic resume).
    plan_start: PlanStart = PlanStart()

    def to_proto(self) -> pb.StreamEpochRequest:
        return pb.StreamEpochRequest(
            dataset=self.dataset,
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            start_batch=self.start_batch,
            end_batch=self.end_batch,
            order=pb.FETCH_ORDER_ORDERED if self.ordered else pb.FETCH_ORDER_UNORDERED,
            prefetch=self.prefetch,
            columns=list(self.columns),
            decode_images=self.decode_images,
            plan_position=self.plan_start.position,
            plan_delivered=list(self.plan_start.delivered),
        )

    @classmethod
    def from_proto(cls, msg: pb.StreamEpochRequest) -> "StreamOptions":
        return cls(
            dataset=msg.dataset,
            batch_size=msg.batch_size,
            seed=msg.seed,
            epoch=msg.epoch,
            rank=msg.rank,
            world_size=msg.world_size or 1,
            drop_last=msg.drop_last,
            start_batch=msg.start_batch,
            end_batch=msg.end_batch,
            ordered=msg.order == pb.FETCH_ORDER_ORDERED,
            prefetch=msg.prefetch,
            columns=tuple(msg.columns),
            decode_images=msg.decode_images,
            # checked with the plan (EpochPlan refuses a start it cannot begin at)
            plan_start=PlanStart(msg.plan_position, tuple(msg.plan_delivered)),
        )

    def with_(self, **changes: object) -> "StreamOptions":
        return replace(self, **changes)
