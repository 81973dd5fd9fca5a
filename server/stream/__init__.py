"""Streaming an epoch, one module per part.

- `epoch_stream`: one call sets up a rank's stream of an epoch (`open_epoch_stream`),
  and what every stream of a server shares (`ServerStreams`).
- `dealer`: a stream's parts (reader, plan, range, limits), chunk encoding, the in-order
  path; `unordered`: the reads of the window all in flight, sent in completion order.
- `budgets`: read slots, encode turns by client, buffered bytes, over all streams.
- `shared_epochs`: identical jobs read each sample once; `tuner`: the online tuner of
  the read limits.
- What those share: `fetch_limits` (a stream's knobs), `rank_batches` (a stream's range
  and planning it), `sample_chunks` (what a stream hands on), `read_observer` (metrics
  hooks), `timer_wheel` (delayed reads on one timer).
- `memory_trim`: freed memory back to the OS after streams end.
"""
