"""Online tuning of each stream's read path: reads in flight, read-ahead, chunk size, flush delay.

Method: a feedback controller per stream, not a search. Every decision period (about one
round of reads: `max(MIN_COMPLETIONS, reads / 2)` completions and MIN_PERIOD_S, or
MAX_PERIOD_S) the
Dealer hands over plain counters: read latencies, samples sent, time its sender waited
for reads (the client is waiting on us; a client that is the slow side shows as a sender
that never waits and an issuer the bound never holds), how often the issuer hit the
in-flight bound, and the event loop's CPU time.

* Reads in flight follow Little's law: to sustain the rate the client drains at with
  reads that take L seconds, `rate x L` reads must be in flight; the target is that times
  HEADROOM (2). L is the storage's own latency: the smoothed period mean, but at most
  1.25x the lowest period mean of the last 30 s. A period's mean also holds queueing (a
  busy CPU, our pools, the storage's queue), which grows with the reads in flight, so a
  target on it alone would chase itself upwards.
  - Growth: while the issuer is held by the bound and the sender starves, the rate is the
    bound's own (rate = reads / L), so the target is 2x the bound: it grows geometrically
    (x1.5 to x2 a step) until the client, the CPU or the storage is the limit.
  - Judging growth: the period after a change is not measured (the new bound is
    filling); growth is judged on the two periods after it against up to four at the old
    bound (one period's rate swings 2x on a busy machine; a low draw looked like a
    plateau).
  - Plateau: growth that twice in a row does not raise the rate by 10%, while the stream
    was held back or each read got 25% slower (the added reads only queued, in our
    process or the storage's), caps the bound at 1.25x the last level that paid. Without
    the latency test a CPU-bound machine whose client takes all it makes would chase its
    own queueing (latency grows with the bound, so rate x latency does) to the ceiling.
  - Lifting a cap: three periods in a row held back at it while reads take no more than
    1.25x the storage's own latency *and* the rate is 10% above the one the cap was set
    at (the load it was learnt under has gone; a cap of 1.25x the knee needs no
    queueing, so latency alone would lift it every few periods), or that latency changing
    2x. A lift whose growth finds the same plateau doubles the periods the next needs (up
    to CAP_LIFT_MAX).
  - Latency probe (TCP BBR's min-RTT probe): after PROBE_EVERY_S in which every period's
    reads queued, the bound is halved for one measured period and restored; else the
    lowest latency of the last 30 s becomes our own queueing once the window passes, and
    the cap and target chase it. Probes are counted apart from changes.
  - A saturated event loop holds the bound. "Held back by the bound" means hit, with the
    sender starving and reads in flight (Little's law on completions) near the bound on
    average. Shrinking waits for three periods in a row that ask for under half the
    bound, and halves at most: a slow client frees memory without the setting hunting.
* The ranks of one job (one dataset, seed, world size and batch size: `job_key`) share
  their storage, and a trainer steps at its slowest rank. Each rank's controller alone
  takes share from the others: growth that took another rank's share pays, the other's
  growth then looks flat and it caps. Through an rclone mount one rank of two grew to 271
  reads in flight while the other capped at 30; it read its 3,000 images in 15.5 s
  against the other's 23.8, and its next epoch, started early, read what the slow rank had
  not cached yet (678 images/s for an epoch otherwise served from memory at 20,000). So
  while a rank's reads queue (slower than the storage's own latency: more of them would
  only take share), its bound is at most SIBLING_LEAD times the lowest bound of its job's
  hungry, settled ranks (held back by their bound, SIBLING_SETTLED decisions made), and at
  most that bound (AHEAD_LEAD) when it is AHEAD_BATCHES batches ahead of the slowest of
  them (or in a later epoch): the one behind may lead it by SIBLING_LEAD and catches up
  (a share under 1, 0.8, let two ranks taking turns ahead ratchet each other down). The
  same run then ended the ranks' cold epochs 0.2-0.8 s apart. A rank whose reads do not
  queue grows freely.
* Read-ahead (prefetch, in batches) keeps twice the in-flight bound in the window, so a
  batch waiting on its slowest read does not drain the pipeline, and at least twice
  WINDOW_MIN_SAMPLES: batches of 16 completed while a message was written then ride along
  in the next message (PendingChunk.at_limits) instead of one message each (one Loader
  rank, page-cached 1 KB rows at batch 16: 32,000-58,000 rows/s against 30,000-34,000).
* Chunk samples follow the drain rate (about CHUNK_TIME_S of samples per message, a
  power of two, within the chunk byte limit): fewer, larger messages for a fast client.
  The flush delay is the time to fill a chunk at the drain rate, shortened to 2 ms while
  the client waits. (Half that time, as before 2026-12-07, flushed chunks half full by
  design: on a server whose loop is the bottleneck the measured rate is its own, and each
  extra message lowered it, so chunks shrank to a quarter of the tuned size. With the full
  time and small chunks encoded on the loop, one rank of 1 KB text rows at batch 64 went
  from 40,000-49,000 to 43,000-72,000 rows/s, alternated on one host: docs/DESIGN.md.)
  Both change only outside a wide dead band, confirmed over two periods.
* Bounds: never above a pinned `--max-reads-per-stream`, this stream's share of
  `--max-reads` (the total over streams), the reads whose bytes fit in the stream's
  `--max-buffered-mb` and its share of `--max-buffered-total-mb`, or `--max-prefetch`.

Why a control loop: the quantities are measured directly and the optimum is a known
function of them (Little's law), so it converges in a handful of periods (a few hundred
samples) and its bounds are plain clamps. A bandit or hill climber would have to explore
settings on a live stream (and keep exploring to track change), paying slow periods to
learn what the measurements already say, and is harder to prove bounded.

A setting the operator pinned (a flag or config key: `--max-reads-per-stream`,
`--prefetch`, `--chunk-samples`, `--flush-delay-ms`), or the prefetch a client asked
for, is never changed. Nothing here runs per sample: the Dealer adds to counters, and
`maybe_decide` costs a comparison until a period is over.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import statistics
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.stream.fetch_limits import FetchLimits

log = logging.getLogger("croupier.autotune")

#: FetchLimits fields the tuner sets (and that a flag or config key pins).
TUNED = ("max_reads_per_stream", "default_prefetch", "chunk_samples", "flush_delay_s")

HEADROOM = 2.0
#: The read-ahead holds at least twice this many samples, however small the batches.
WINDOW_MIN_SAMPLES = 64
START_READS = 16
MIN_READS = 4
MIN_COMPLETIONS = 32
MIN_PERIOD_S = 0.05
MAX_PERIOD_S = 0.5
SHRINK_AFTER = 3
#: Growth must raise the drain rate by this much, or it counts towards a plateau.
PLATEAU_GAIN = 1.1
PLATEAU_STRIKES = 2
#: Growth is judged on this many measured periods at the new bound, against up to
#: LEVEL_PERIODS at the old: one period's rate can swing 2x on a busy machine.
JUDGE_PERIODS = 2
LEVEL_PERIODS = 4
#: After growth with a flat rate, latency up by this factor means the new reads only queued.
QUEUED_LATENCY = 1.25
#: The storage's own latency is the lowest period mean over this long (and this many periods).
BASE_WINDOW_S = 30.0
BASE_PERIODS = 2000
#: Periods in a row held back at the cap with reads at the storage's own latency (and a rate
#: 10% above the one the cap was learnt at) that lift it; doubled, up to CAP_LIFT_MAX, each
#: time growth past a lifted cap found the same plateau again.
CAP_LIFT_AFTER = 3
CAP_LIFT_MAX = 96
#: No period this long with reads at the storage's own latency (every one queued, or the
#: storage slower than the base says): drain to half the bound for one measured period, so
#: the base is measured again without our own queueing in it (BBR's min-RTT probe).
PROBE_EVERY_S = 10.0
#: Event-loop thread busy this share of a period: hold, more reads would only queue.
LOOP_SATURATED = 0.9
CHUNK_TIME_S = 0.004
MIN_CHUNK, MAX_CHUNK = 16, 1024
FLUSH_MIN_S, FLUSH_MAX_S, FLUSH_WAITING_S = 0.001, 0.010, 0.002
#: A stream's log line about its settings comes at most this often.
LOG_EVERY_S = 2.0
#: While its reads queue, a rank's reads in flight stay within this times the lowest bound of
#: its job's other hungry ranks (`job_key`): ranks climb together, a step of 1.25x at a time.
SIBLING_LEAD = 1.25
#: Decisions a rank makes before its bound holds its siblings back.
SIBLING_SETTLED = 4
#: A rank this many batches ahead of its slowest sibling (or in a later epoch) keeps to this
#: times that sibling's bound, which may lead it by SIBLING_LEAD and so catches up. Under 1
#: two ranks taking turns ahead would ratchet each other down a step per turn.
AHEAD_BATCHES = 2
AHEAD_LEAD = 1.0


def job_key(dataset: str, plan: EpochPlan) -> Hashable | None:
    """The job a rank's stream belongs to (its siblings: the other ranks of one epoch plan
    of `dataset`, whichever epoch they are in); None for a job of one rank."""
    if plan.world_size <= 1:
        return None
    return (dataset, plan.seed, plan.world_size, plan.batch_size)


@dataclass(frozen=True)
class Settings:
    reads: int
    prefetch: int
    chunk_samples: int
    flush_delay_s: float

    def apply(self, limits: FetchLimits) -> FetchLimits:
        return dataclasses.replace(limits, max_reads_per_stream=self.reads, default_prefetch=self.prefetch,
                                   chunk_samples=self.chunk_samples, flush_delay_s=self.flush_delay_s)

    def describe(self) -> str:
        return (f"reads in flight {self.reads}, prefetch {self.prefetch}, chunk {self.chunk_samples} samples, "
                f"flush {self.flush_delay_s * 1000:g} ms")


class Phase(enum.Enum):
    """The phases of the reads-in-flight bound's controller, one step per decision period.

    Every change of the bound goes through FILLING (its period fills the new bound and is
    not measured) into the phase it was made for: growth into JUDGING, a probe's halving
    into PROBING, anything else (a cap, a shrink, a tighter ceiling, a probe's end) into
    TRACKING; a change that leaves the bound where it was skips FILLING. JUDGING returns
    to TRACKING once it has judged; a probe may start in any measured phase (TRACKING,
    JUDGING) once every read queued for PROBE_EVERY_S.
    """

    #: Little's law on the storage's own latency sets the bound (grow, shrink, obey a tighter ceiling).
    TRACKING = "tracking"
    #: The period right after the bound changed fills the new bound: not a measurement.
    FILLING = "filling"
    #: Growth is judged on JUDGE_PERIODS measured periods at the new bound against the old.
    JUDGING = "judging"
    #: The bound is halved for one measured period (BBR's min-RTT probe), then restored.
    PROBING = "probing"


@dataclass
class _Measured:
    """One period's measurements, as the phase methods read them. Judging growth swaps
    in the level's rate and latency for the tracking that follows it."""

    rate: float
    lat: float
    base: float
    ceiling: int
    supply_bound: bool
    loop_busy: float
    now: float


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


class StreamTuner:
    """One stream's controller. The Dealer adds to the public counters; `maybe_decide`
    turns a finished period into new `Settings` (or None: unchanged)."""

    def __init__(self, server: "Autotuner", *, batch_size: int, requested_prefetch: int | None = None,
                 name: str = "", clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time, job: Hashable | None = None, epoch: int = 0):
        self.server = server
        self.batch_size = batch_size
        self.name = name
        self.job = job  # `job_key`: the other ranks of its job bound its growth (None: alone)
        #: Where this rank is in its job: the epoch, and the samples sent in it so far (at
        #: the last decision): a rank ahead of its slowest sibling yields (`sibling_room`).
        self.epoch = epoch
        self.delivered = 0
        self.clock, self.cpu_clock = clock, cpu_clock
        # Counters the Dealer adds to (reset each period).
        self.done = 0
        self.lat_sum = 0.0
        self.sent = 0
        self.sent_bytes = 0
        self.starved_s = 0.0
        self.bound_hits = 0
        #: The bound held the stream back in the last period (its siblings read it: `sibling_room`).
        self.held = False
        #: The last period's reads took longer than the storage's own latency: they queued
        #: (in the storage, our pools, a busy CPU), so more of them would take share from others.
        self.queued = False
        # Controller state.
        self.latency_s: float | None = None
        self.rate: float | None = None
        self.item_bytes: float | None = None
        self.decisions = 0
        self.changes = 0
        self.cap: int | None = None
        self._cap_base = 0.0
        self._unqueued = 0  # periods in a row held back at the cap with no queueing
        self._cap_rate = 0.0  # the drain rate when the cap was set
        self._lift_after = CAP_LIFT_AFTER
        self._lifted: int | None = None  # the cap last lifted, until growth sets the next
        self._probe_from: int | None = None  # the bound to go back to after a drain probe
        self._period_lat = 0.0
        self.probes = 0
        self._probing = False  # this decision starts or ends a probe (not counted as a change)
        #: (time, mean read latency) of recent periods: their minimum is the storage's own latency.
        self._latencies: collections.deque[tuple[float, float]] = collections.deque(maxlen=BASE_PERIODS)
        self._strikes = 0
        self._grew_from: tuple[int, float, float] | None = None  # (reads, rate, latency) before the last growth
        #: (samples sent, seconds, reads done, latency sum) of the measured periods at the current bound.
        self._level: collections.deque[tuple[int, float, int, float]] = collections.deque(maxlen=LEVEL_PERIODS)
        self._period: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)
        self._paid: int | None = None  # reads at the last growth that raised the rate
        self._shrink_votes = 0
        #: Where the reads-in-flight bound's controller is (see `Phase`), and where it goes
        #: once a new bound has filled.
        self.phase = Phase.TRACKING
        self._after_fill = Phase.TRACKING
        self._chunk_vote: int | None = None
        self._flush_vote: float | None = None
        self._t = clock()
        self._unqueued_at = self._t  # the last period whose reads took the storage's own latency
        self._cpu = cpu_clock()
        self._next_done = MIN_COMPLETIONS
        self._logged_at = float("-inf")
        self._unlogged: Settings | None = None
        lim, pinned = server.limits, set(server.pinned)
        if requested_prefetch is not None:
            pinned.add("default_prefetch")
        self.pinned = frozenset(pinned)
        prefetch = min(requested_prefetch if requested_prefetch is not None else lim.default_prefetch,
                       lim.max_prefetch)
        self.settings = Settings(lim.max_reads_per_stream, prefetch, lim.chunk_samples, lim.flush_delay_s)
        if "max_reads_per_stream" not in self.pinned:
            self.settings = dataclasses.replace(self.settings, reads=min(START_READS, self.ceiling()))
        if "default_prefetch" not in self.pinned:
            self.settings = dataclasses.replace(self.settings, prefetch=self._prefetch_for(self.settings.reads))
        #: (seconds since start, Settings) at every change, for benchmarks and tests.
        self.history: list[tuple[float, Settings]] = [(0.0, self.settings)]
        self._t0 = self._t

    # ---- bounds -------------------------------------------------------------------
    def ceiling(self) -> int:
        """The most reads in flight this stream may have now (every server-wide bound)."""
        lim = self.server.limits
        if "max_reads_per_stream" in self.pinned:
            return lim.max_reads_per_stream
        n = max(1, self.server.active())
        top = max(MIN_READS, self.server.max_reads // n)
        item = self.item_bytes or 0
        if item > 0:  # every read in flight may end up buffered (a client that stops reading)
            room = lim.max_buffered_bytes
            if self.server.total_buffered_bytes:
                room = min(room, self.server.total_buffered_bytes // n)
            top = min(top, max(MIN_READS, int(room // item)))
        if "default_prefetch" in self.pinned:
            top = min(top, (self.settings.prefetch + 1) * self.batch_size)
        room = self.sibling_room()
        if room is not None:
            top = min(top, room)
        return max(1, min(top, self.server.max_reads))

    def sibling_room(self) -> int | None:
        """The most reads in flight this rank may have beside the other ranks of its job,
        while its reads queue (reads that do not queue take nobody's share: served from
        memory, or from storage with room to spare, it grows freely), that want more reads
        than they have (their bound held them back last period: a rank near the end of its
        epoch, or whose client is the slow side, holds nobody back) and have settled
        (SIBLING_SETTLED decisions: nor does a rank just starting its next epoch at
        START_READS); None when there are none."""
        if not self.queued:
            return None
        hungry = [t for t in self.server.siblings(self) if t.held and t.decisions >= SIBLING_SETTLED]
        if not hungry:
            return None
        slowest = min(hungry, key=lambda t: (t.epoch, t.delivered))
        ahead = (self.epoch, self.delivered - AHEAD_BATCHES * self.batch_size) > (slowest.epoch, slowest.delivered)
        low = min(t.steady_reads() for t in hungry)
        return max(MIN_READS, math.ceil((AHEAD_LEAD if ahead else SIBLING_LEAD) * low))

    def steady_reads(self) -> int:
        """The bound as its siblings should see it: a latency probe's halving is not it."""
        return self._probe_from if self._probe_from is not None else self.settings.reads

    def _prefetch_for(self, reads: int) -> int:
        """Batches of read-ahead: twice the in-flight bound, and at least twice
        WINDOW_MIN_SAMPLES (small batches: what completes while a message is written goes in
        the next, not in one message a batch, each about 100 us of the loop's time in grpc)."""
        return max(2, min(self.server.limits.max_prefetch,
                          math.ceil(HEADROOM * max(reads, WINDOW_MIN_SAMPLES) / self.batch_size)))

    # ---- the period -----------------------------------------------------------------
    def maybe_decide(self) -> Settings | None:
        """New settings once a period is over (None while it runs, or if nothing changes)."""
        if self.done < self._next_done:
            now = self.clock()
            if now - self._t < MAX_PERIOD_S or self.done == 0:
                return None
        else:
            now = self.clock()
            if now - self._t < MIN_PERIOD_S:
                return None
        return self._decide(now)

    def _decide(self, now: float) -> Settings | None:
        elapsed = max(now - self._t, 1e-9)
        cpu = self.cpu_clock()
        loop_busy = (cpu - self._cpu) / elapsed
        lat = self.lat_sum / self.done if self.done else self.latency_s or 0.0
        rate = self.sent / elapsed
        self.latency_s = lat if self.latency_s is None else 0.5 * self.latency_s + 0.5 * lat
        if self.done:
            self._latencies.append((now, lat))
        self._period_lat = lat
        self._period = (self.sent, elapsed, self.done, self.lat_sum)
        self.rate = rate if self.rate is None else 0.5 * self.rate + 0.5 * rate
        if self.sent:
            b = self.sent_bytes / self.sent
            self.item_bytes = b if self.item_bytes is None else 0.5 * self.item_bytes + 0.5 * b
        starved = self.starved_s / elapsed
        old = self.settings
        # The bound holds the stream back: hit, the sender starving, and (Little's law on
        # the completions) reads in flight near the bound on average, not in a burst.
        in_flight = self.done / elapsed * lat
        supply_bound = self.bound_hits > 0 and starved >= 0.05 and in_flight >= 0.6 * old.reads
        self.held = supply_bound
        new = old
        if "max_reads_per_stream" not in self.pinned:
            new = dataclasses.replace(new, reads=self._reads(old.reads, rate, supply_bound, loop_busy, now))
        if "default_prefetch" not in self.pinned:
            new = dataclasses.replace(new, prefetch=self._prefetch_for(new.reads))
        if "chunk_samples" not in self.pinned:
            new = dataclasses.replace(new, chunk_samples=self._chunk(old.chunk_samples))
        if "flush_delay_s" not in self.pinned:
            new = dataclasses.replace(new, flush_delay_s=self._flush(old.flush_delay_s, new.chunk_samples, starved))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("autotune %s: period %.3f s: %d reads done, latency %.1f ms (smoothed %.1f), %.0f samples/s, "
                      "in flight %.0f of %d, bound hit %d, sender waited %.0f%%, loop busy %.0f%%; cap %s -> reads %d",
                      self.name, elapsed, self.done, 1000 * lat, 1000 * self.latency_s, rate, in_flight, old.reads,
                      self.bound_hits, 100 * starved, 100 * loop_busy, self.cap, new.reads)
        self.decisions += 1
        self.server.decisions += 1
        self.delivered += self.sent
        self.done = self.sent = self.sent_bytes = self.bound_hits = 0
        self.lat_sum = self.starved_s = 0.0
        self._t, self._cpu = now, cpu
        self._next_done = max(MIN_COMPLETIONS, new.reads // 2)
        probing, self._probing = self._probing, False
        if new == old:
            return None
        self.settings = new
        if len(self.history) < 1000:
            self.history.append((now - self._t0, new))
        if probing and new.chunk_samples == old.chunk_samples and new.flush_delay_s == old.flush_delay_s:
            log.debug("autotune %s: latency probe: reads in flight %d -> %d", self.name, old.reads, new.reads)
            return new
        self.changes += 1
        self.server.changes += 1
        self._log(now, old, new, rate, starved)
        return new

    def base_latency(self, now: float) -> float:
        """The storage's own read latency: the lowest period mean of the last BASE_WINDOW_S.
        A period's mean includes queueing (in our process, on a busy CPU, in the storage),
        which grows with the reads in flight; the lowest recent one is the least of it."""
        while len(self._latencies) > 1 and now - self._latencies[0][0] > BASE_WINDOW_S:
            self._latencies.popleft()
        return min((lat for _, lat in self._latencies), default=self.latency_s or 0.0)

    def _reads(self, cur: int, rate: float, supply_bound: bool, loop_busy: float, now: float) -> int:
        """The reads-in-flight bound for the next period: one step of the phase machine
        (`Phase`). Filling and the end of a probe are not measured; every other period is
        (it joins the level, may start a probe, may lift or drop the cap), then growth is
        judged or Little's law tracked."""
        base = self.base_latency(now)
        self.queued = self._period_lat > base * QUEUED_LATENCY
        m = _Measured(rate=rate, lat=self.latency_s or 0.0, base=base, ceiling=self.ceiling(),
                      supply_bound=supply_bound, loop_busy=loop_busy, now=now)
        if self.phase is Phase.FILLING:
            self.phase = self._after_fill
            return min(cur, m.ceiling)
        if self.phase is Phase.PROBING:
            return self._end_probe(m)
        self._level.append(self._period)
        if self._period_lat <= m.base * QUEUED_LATENCY:
            self._unqueued_at = now
        elif now - self._unqueued_at >= PROBE_EVERY_S and cur > MIN_READS:
            return self._start_probe(cur)
        self._revise_cap(cur, m)
        if self.phase is Phase.JUDGING:
            judged = self._judge_growth(cur, m)
            if judged is not None:
                return judged
        return self._track(cur, m)

    def _start_probe(self, cur: int) -> int:
        """Every read queued for PROBE_EVERY_S: the base may be stale (or hold our own
        queueing once its window passes). Half the bound for one measured period says."""
        self._probe_from, self._grew_from, self._strikes = cur, None, 0
        self.probes += 1
        self.server.probes += 1
        self._probing = True
        return self._changed(max(MIN_READS, cur // 2), then=Phase.PROBING)

    def _end_probe(self, m: _Measured) -> int:
        """The probe's period was measured (and is in the base): back to the bound before."""
        back, self._probe_from = self._probe_from, None
        self._unqueued_at, self._probing = m.now, True
        return self._changed(min(back, m.ceiling), then=Phase.TRACKING)

    def _revise_cap(self, cur: int, m: _Measured) -> None:
        """Drop the cap when the storage changed; lift it after CAP_LIFT_AFTER (or more)
        periods held back at it with reads at the storage's own latency."""
        if self.cap is not None and not 0.5 <= m.base / max(self._cap_base, 1e-9) <= 2.0:
            self.cap, self._strikes, self._lift_after = None, 0, CAP_LIFT_AFTER  # the storage changed
        if (self.cap is not None and cur >= self.cap and m.supply_bound and m.lat <= m.base * QUEUED_LATENCY
                and m.rate >= self._cap_rate * PLATEAU_GAIN):
            # Held back at the cap, yet reads take the storage's own time and the rate has
            # risen since the cap was set: the plateau was learnt under a load that has gone,
            # so growth may pay again. (At a cap of 1.25x the knee reads need not queue, so
            # the latency alone would lift it every few periods: hunting.)
            self._unqueued += 1
            if self._unqueued >= self._lift_after:
                self._lifted = self.cap
                self.cap, self._strikes, self._unqueued = None, 0, 0
        else:
            self._unqueued = 0

    def _judge_growth(self, cur: int, m: _Measured) -> int | None:
        """Did the last growth pay? Measured on the first JUDGE_PERIODS periods at the new
        bound. Returns the bound when the judgement decides it, else None (track, on the
        level's rate and latency, now in `m`)."""
        if len(self._level) < JUDGE_PERIODS:
            return cur
        before_reads, before_rate, before_lat = self._grew_from
        self._grew_from, self.phase = None, Phase.TRACKING
        m.rate, m.lat = self._level_rate(m.rate, m.lat)
        flat = m.rate < before_rate * PLATEAU_GAIN
        # Queueing: more reads in flight, the same rate, each read slower (Little's law).
        # Latency measured under it grows with the bound, so the target (rate x latency)
        # would chase it to the ceiling; a held-back stream whose rate stays flat is the
        # same plateau seen from the sender.
        queued = flat and m.lat >= before_lat * QUEUED_LATENCY
        if (m.supply_bound and flat) or queued:
            self._strikes += 1
            if self._strikes >= PLATEAU_STRIKES:
                return self._set_cap(cur, before_reads, before_rate, m)
            return cur  # once may be noise: hold, and try growing again next period
        self._strikes = 0
        if not flat:
            self._paid = cur
        return None

    def _set_cap(self, cur: int, before_reads: int, before_rate: float, m: _Measured) -> int:
        """A plateau: back to just above the last level that paid; more only queued."""
        paid_reads = self._paid or before_reads
        self.cap, self._cap_base = max(MIN_READS, int(paid_reads * 1.25)), m.base
        self._cap_rate, self._strikes = max(m.rate, before_rate), 0
        if self._lifted is not None:  # growth past a lifted cap: was it worth it?
            same = self.cap <= 1.5 * self._lifted
            self._lift_after = min(CAP_LIFT_MAX, 2 * self._lift_after) if same else CAP_LIFT_AFTER
            self._lifted = None
        return self._changed(min(cur, self.cap, m.ceiling), then=Phase.TRACKING)

    def _track(self, cur: int, m: _Measured) -> int:
        """Little's law on the storage's own latency, not the queued one: reads beyond what
        that sustains only wait longer (a stream the bound really holds back grows)."""
        # The mean is used while it stays within 1.25x the lowest (a lognormal storage's
        # lowest period mean sits under its mean); past that, the rest is queueing.
        needed = m.rate * min(m.lat, m.base * QUEUED_LATENCY) * HEADROOM
        want = needed
        if m.supply_bound and m.loop_busy < LOOP_SATURATED:
            want = max(needed, cur * 1.5)
        elif m.supply_bound:
            want = cur  # the event loop is saturated: more reads would only queue
        top = m.ceiling if self.cap is None else min(m.ceiling, self.cap)
        want_i = int(min(max(want, MIN_READS), top))
        if cur > m.ceiling:  # a bound tightened (more streams, bigger samples): obey at once
            self._shrink_votes = 0
            return self._changed(m.ceiling, then=Phase.TRACKING)
        if want_i >= cur * 1.25:
            self._shrink_votes = 0
            self._grew_from = (cur, *self._level_rate(m.rate, m.lat))
            return self._changed(min(want_i, 2 * cur), then=Phase.JUDGING)
        if want_i <= cur * 0.5:
            self._shrink_votes += 1
            if self._shrink_votes >= SHRINK_AFTER:
                self._shrink_votes = 0
                return self._changed(max(want_i, cur // 2, MIN_READS), then=Phase.TRACKING)
            return cur
        self._shrink_votes = 0
        return cur

    def _level_rate(self, rate: float, lat: float) -> tuple[float, float]:
        """Drain rate and mean read latency over the measured periods at the current bound."""
        sent = sum(p[0] for p in self._level)
        secs = sum(p[1] for p in self._level)
        done = sum(p[2] for p in self._level)
        lat_sum = sum(p[3] for p in self._level)
        return (sent / secs if secs > 0 else rate), (lat_sum / done if done else lat)

    def _changed(self, reads: int, *, then: Phase) -> int:
        """Enter `then` with bound `reads`; through FILLING first if the bound changed
        (the period that fills a new bound is not a measurement of it)."""
        if reads != self.settings.reads:
            self.phase, self._after_fill = Phase.FILLING, then
            self._level.clear()
        else:
            self.phase = then
        return reads

    def _chunk(self, cur: int) -> int:
        rate = self.rate or 0.0
        target = rate * CHUNK_TIME_S
        if self.item_bytes:
            target = min(target, self.server.limits.chunk_bytes / self.item_bytes)
        target = min(max(target, MIN_CHUNK), MAX_CHUNK)
        proposal = cur
        if target >= 2 * cur or target < cur / 4:
            proposal = max(MIN_CHUNK, min(MAX_CHUNK, _pow2_floor(target)))
        return self._confirm("_chunk_vote", cur, proposal)

    def _flush(self, cur: float, chunk: int, starved: float) -> float:
        rate = self.rate or 0.0
        target = FLUSH_MAX_S if rate <= 0 else chunk / rate
        if starved >= 0.2:
            target = min(target, FLUSH_WAITING_S)
        target = min(max(target, FLUSH_MIN_S), FLUSH_MAX_S)
        proposal = cur
        if target >= 2 * cur or target <= cur / 2:
            proposal = round(target, 3)
        return self._confirm("_flush_vote", cur, proposal)

    def _confirm(self, slot: str, cur, proposal):
        """A change of chunk or flush happens when two periods in a row propose it."""
        if proposal == cur:
            setattr(self, slot, None)
            return cur
        if getattr(self, slot) is not None:
            setattr(self, slot, None)
            return proposal
        setattr(self, slot, proposal)
        return cur

    # ---- log --------------------------------------------------------------------------
    def _log(self, now: float, old: Settings, new: Settings, rate: float, starved: float) -> None:
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged = new
            return
        self._logged_at, self._unlogged = now, None
        log.info("autotune %s: %s (was %s; read latency %.1f ms, %.0f samples/s, sender waited on reads %.0f%%)",
                 self.name, new.describe(), old.describe(), 1000 * (self.latency_s or 0), rate, 100 * starved)

    def close(self) -> None:
        """The stream ended: one line with where it settled, if not said already."""
        self.server.forget(self)
        if self._unlogged is not None or self.changes:
            log.info("autotune %s: ended at %s after %d decisions, %d changes", self.name,
                     self.settings.describe(), self.decisions, self.changes)


class Autotuner:
    """The server's side: bounds shared by all streams, the live tuners, their metrics.

    Registered on the metrics registry as a collector: gauges of the settings over the
    tuned streams (min, median, max: bounded cardinality however many streams run).
    """

    def __init__(self, limits: FetchLimits, *, max_reads: int, total_buffered_bytes: int = 0,
                 pinned: Iterable[str] = ()):
        pinned = frozenset(pinned)
        unknown = pinned - set(TUNED)
        if unknown:
            raise ValueError(f"autotune: cannot pin {sorted(unknown)[0]!r}; tuned settings: {list(TUNED)}")
        self.limits = limits
        self.max_reads = max_reads
        self.total_buffered_bytes = total_buffered_bytes
        self.pinned = pinned
        self.streams: set[StreamTuner] = set()
        #: The tuned streams of each job of several ranks (`job_key`).
        self.jobs: dict[Hashable, set[StreamTuner]] = {}
        #: The last streams that ended (their settings over time: tests, benchmarks).
        self.recent: collections.deque[StreamTuner] = collections.deque(maxlen=8)
        self.decisions = 0
        self.changes = 0
        self.probes = 0

    def active(self) -> int:
        return len(self.streams)

    def stream(self, *, batch_size: int, requested_prefetch: int | None = None, name: str = "",
               clock: Callable[[], float] = time.perf_counter,
               cpu_clock: Callable[[], float] = time.thread_time, job: Hashable | None = None,
               epoch: int = 0) -> StreamTuner:
        tuner = StreamTuner(self, batch_size=batch_size, requested_prefetch=requested_prefetch, name=name,
                            clock=clock, cpu_clock=cpu_clock, job=job, epoch=epoch)
        self.resume(tuner)
        return tuner

    def siblings(self, tuner: StreamTuner) -> list[StreamTuner]:
        """The other tuned streams of `tuner`'s job."""
        if tuner.job is None:
            return []
        return [t for t in self.jobs.get(tuner.job, ()) if t is not tuner]

    def idle(self, tuner: StreamTuner) -> None:
        """`tuner`'s stream is read for by a shared epoch's tuner for now: off the gauges,
        the count of streams sharing --max-reads and its job's ranks, until `resume`."""
        self.streams.discard(tuner)
        self._leave_job(tuner)

    def resume(self, tuner: StreamTuner) -> None:
        self.streams.add(tuner)
        if tuner.job is not None:
            self.jobs.setdefault(tuner.job, set()).add(tuner)

    def forget(self, tuner: StreamTuner) -> None:
        self._leave_job(tuner)
        if tuner in self.streams:
            self.streams.discard(tuner)
            self.recent.append(tuner)

    def _leave_job(self, tuner: StreamTuner) -> None:
        ranks = self.jobs.get(tuner.job) if tuner.job is not None else None
        if ranks is not None:
            ranks.discard(tuner)
            if not ranks:
                del self.jobs[tuner.job]

    def collect(self):
        settings = [t.settings for t in list(self.streams)]
        yield GaugeMetricFamily("croupier_autotune_streams", "Streams whose settings the autotuner sets",
                                value=len(settings))
        for name, text, get in (
            ("croupier_autotune_reads_in_flight", "Reads in flight bound the autotuner set, over tuned streams",
             lambda s: s.reads),
            ("croupier_autotune_prefetch", "Read-ahead (batches) the autotuner set, over tuned streams",
             lambda s: s.prefetch),
            ("croupier_autotune_chunk_samples", "Samples per message the autotuner set, over tuned streams",
             lambda s: s.chunk_samples),
            ("croupier_autotune_flush_delay_ms", "Flush delay (ms) the autotuner set, over tuned streams",
             lambda s: 1000 * s.flush_delay_s),
        ):
            g = GaugeMetricFamily(name, text, labels=["stat"])
            if settings:
                values = [float(get(s)) for s in settings]
                g.add_metric(["min"], min(values))
                g.add_metric(["median"], statistics.median(values))
                g.add_metric(["max"], max(values))
            yield g
        d = CounterMetricFamily("croupier_autotune_decisions", "Autotune decision periods, all streams")
        d.add_metric([], self.decisions)
        yield d
        c = CounterMetricFamily("croupier_autotune_changes", "Autotune decisions that changed a setting "
                                "(latency probes apart)")
        c.add_metric([], self.changes)
        yield c
        p = CounterMetricFamily("croupier_autotune_probes", "Autotune latency probes: reads in flight halved for "
                                "one measured period after PROBE_EVERY_S with every read queued")
        p.add_metric([], self.probes)
        yield p
