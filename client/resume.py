"""Where a Loader resumes: its cursor, and the cursor that saved states lead to.

A Loader is a cursor over the sequence of epochs: the epoch and plan the next batch
comes from, and which of that plan's batches this rank has handed out (`next_batch`, and
with `in_order=False` the batches handed out ahead of it). A state saved at the Loader's
own shape resumes the cursor as it was. A state saved at another world size, batch size
or `drop_last` (an elastic resume) resumes at the epoch's samples that no rank had
delivered: they become a `PlanStart`, the rest of the permutation cut anew at the new
shape (croupier/protocol/epoch_plan.py). Pure: no network, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from croupier.protocol.epoch_plan import EpochPlan, PlanStart

#: The keys of a state that must agree across the ranks' states of one checkpoint.
_SHARED_KEYS = ("seed", "epoch", "world_size", "batch_size", "drop_last", "plan_position", "plan_delivered",
                "num_rows")


class ResumeError(ValueError):
    """Saved states that cannot be resumed from; the message names the ranks, steps and fields."""


@dataclass(frozen=True)
class Shape:
    """What decides how a plan is cut: one rank's view of the job."""

    rank: int
    world_size: int
    batch_size: int
    drop_last: bool


@dataclass
class Cursor:
    """Where a Loader stands: the next batch it hands out comes from `epoch`'s plan that
    begins at `start`, at `next_batch` (skipping `ahead`, handed out already)."""

    seed: int
    epoch: int
    start: PlanStart = PlanStart()
    next_batch: int = 0
    ahead: set[int] = field(default_factory=set)

    @property
    def step(self) -> int:
        """Batches of this plan handed out."""
        return self.next_batch + len(self.ahead)

    def handed_out(self, batch: int) -> None:
        if batch == self.next_batch:
            self.next_batch += 1
            while self.next_batch in self.ahead:
                self.ahead.discard(self.next_batch)
                self.next_batch += 1
        else:
            self.ahead.add(batch)

    def next_epoch(self) -> None:
        self.epoch, self.start, self.next_batch, self.ahead = self.epoch + 1, PlanStart(), 0, set()


def state_of(cursor: Cursor, dataset: str, shape: Shape, num_rows: int | None) -> dict[str, Any]:
    """A Loader's `state_dict()`: plain integers, lists and strings."""
    position = None
    if num_rows is not None:
        # Where in P the ranks stand if all of them are at this step with nothing ahead.
        plan = _plan(num_rows, cursor, shape)
        q = min(cursor.next_batch * plan.global_batch_size, plan.remaining)
        position = int(cursor.start.to_positions(q)) if q < plan.remaining else num_rows
    return {
        "dataset": dataset,
        "num_rows": num_rows,
        "seed": cursor.seed,
        "epoch": cursor.epoch,
        "position": position,
        "step": cursor.step,
        "next_batch": cursor.next_batch,
        "batches_ahead": sorted(cursor.ahead),
        "plan_position": cursor.start.position,
        "plan_delivered": list(cursor.start.delivered),
        "rank": shape.rank,
        "world_size": shape.world_size,
        "batch_size": shape.batch_size,
        "drop_last": shape.drop_last,
    }


def _plan(num_rows: int, cursor: Cursor, shape: Shape) -> EpochPlan:
    return EpochPlan(num_rows, cursor.seed, cursor.epoch, shape.batch_size, shape.world_size, shape.drop_last,
                     cursor.start)


def _cursor(state: Mapping[str, Any]) -> Cursor:
    start = PlanStart(int(state.get("plan_position", 0)), tuple(int(v) for v in state.get("plan_delivered", ())))
    return Cursor(int(state["seed"]), int(state["epoch"]), start, int(state["next_batch"]),
                  {int(b) for b in state.get("batches_ahead", ())})


def _shape(state: Mapping[str, Any], fallback: Shape) -> Shape:
    return Shape(int(state.get("rank", fallback.rank)), int(state.get("world_size", fallback.world_size)),
                 int(state.get("batch_size", fallback.batch_size)), bool(state.get("drop_last", fallback.drop_last)))


def _where(states: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"rank {s.get('rank', '?')} at epoch {s['epoch']} step {_cursor(s).step}" for s in states)


def _check_one_checkpoint(states: Sequence[Mapping[str, Any]]) -> None:
    """Refuse states of ranks that stopped at different steps, or of different runs."""
    ranks = [s.get("rank") for s in states]
    if len(set(ranks)) != len(ranks):
        raise ResumeError(f"the states given hold rank {next(r for r in ranks if ranks.count(r) > 1)} twice: "
                          "give each rank's state once")
    if len({(int(s["epoch"]), _cursor(s).step) for s in states}) > 1:
        raise ResumeError(f"the ranks stopped at different steps ({_where(states)}): their states are not of one "
                          "checkpoint, and no resume loses or repeats nothing from them; resume from states saved "
                          "at the same step")
    for key in _SHARED_KEYS:
        values = {repr(s.get(key)) for s in states}
        if len(values) > 1:
            raise ResumeError(f"the states disagree on {key}: "
                              + ", ".join(f"rank {s.get('rank', '?')} has {s.get(key)!r}" for s in states))


def resume_cursor(states: Sequence[Mapping[str, Any]], dataset: str, shape: Shape) -> Cursor:
    """The cursor a Loader of `shape` resumes at from one rank's state or every rank's.

    At the saved shape, this rank's own state resumes exactly where it stood; another
    rank's (a checkpoint that kept only rank 0's) resumes at its step, which every rank
    reached together. At another shape, the plan begins after every sample the old ranks
    delivered: up to the step they reached together, plus, with `in_order=False`, the
    batches they handed out ahead of it, which only all of the old ranks' states tell.
    """
    if not states:
        raise ResumeError("no state given")
    for s in states:
        if s.get("dataset", dataset) != dataset:
            raise ResumeError(f"the state was saved for dataset {s['dataset']!r}, this Loader reads {dataset!r}")
    _check_one_checkpoint(states)
    saved = _shape(states[0], shape)
    cursors = {_shape(s, shape).rank: _cursor(s) for s in states}
    same_shape = (saved.world_size, saved.batch_size, saved.drop_last) == (
        shape.world_size, shape.batch_size, shape.drop_last)
    if same_shape and shape.rank in cursors:
        return cursors[shape.rank]
    ahead = {r: sorted(c.ahead) for r, c in cursors.items() if c.ahead}
    missing = sorted(set(range(saved.world_size)) - set(cursors))
    if ahead and missing:
        held = "; ".join(f"rank {r} handed out batch{'es' if len(a) > 1 else ''} {', '.join(map(str, a))} ahead "
                         f"of batch {cursors[r].next_batch}" for r, a in sorted(ahead.items()))
        raise ResumeError(
            f"the state is not at a global-batch boundary ({held}, with in_order=False), so the old ranks "
            f"delivered different batches; the states of rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} (of world size {saved.world_size}) are needed too: "
            "pass every rank's state, load_state_dict([state_0, state_1, ...])"
        )
    first = next(iter(cursors.values()))
    if same_shape:  # another rank's state, at a boundary every rank reached
        return Cursor(first.seed, first.epoch, first.start, first.next_batch)
    return _elastic(states, first, saved, cursors)


def _elastic(states: Sequence[Mapping[str, Any]], first: Cursor, saved: Shape, cursors: dict[int, Cursor]) -> Cursor:
    """The cursor at the start of the rest of the epoch, whatever the new shape."""
    num_rows = states[0].get("num_rows")
    if num_rows is not None and first.next_batch >= _plan(int(num_rows), first, saved).num_batches:
        # The epoch was over (with drop_last, its tail too): the next one, whole.
        return Cursor(first.seed, first.epoch + 1)
    if not any(c.ahead for c in cursors.values()):
        g = saved.batch_size * saved.world_size
        remaining = num_rows - first.start.skipped if num_rows is not None else None
        end = first.next_batch * g if remaining is None else min(first.next_batch * g, remaining)
        start = first.start.after([(0, end)], end if remaining is None else remaining)
    else:
        if num_rows is None:
            raise ResumeError("the states hold batches ahead but not the dataset's num_rows: they predate "
                              "elastic resume; resume at the shape they were saved at")
        plan = _plan(int(num_rows), first, saved)
        # Every rank handed out all batches below the lowest next_batch (full ones: the
        # short last batch is never below a next_batch); the rest rank by rank.
        low = min(c.next_batch for c in cursors.values())
        ranges = [(0, low * plan.global_batch_size)]
        ranges += [plan.slot_range(r, b) for r, c in cursors.items() for b in [*range(low, c.next_batch), *c.ahead]]
        start = first.start.after(ranges, plan.remaining)
    cursor = Cursor(first.seed, first.epoch, start)
    if num_rows is not None and start.skipped >= int(num_rows):
        cursor.next_epoch()  # every sample of the epoch was delivered
    return cursor
