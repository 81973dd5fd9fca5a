"""Which chunks the server encodes on its event loop and which in its CPU pool
(`Reader.encodes_on_loop`): a hop to the pool and back costs each side two wake-ups, more
than encoding a small chunk of table rows, so chunks of rows up to
`arrow_ipc.ENCODE_ON_LOOP_BYTES` stay on the loop and larger ones go to the pool, which
the loop must not be held by. A real server on loopback, real Arrow IPC files, a Loader."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from croupier.client import Loader
from croupier.server.readers.arrow_ipc import ENCODE_ON_LOOP_BYTES
from executor_counts import encodes_in_executor


def _write(path: Path, rows: int, row_bytes: int) -> pa.Table:
    table = pa.table({"id": list(range(rows)), "text": [f"{i:08d}".ljust(row_bytes, "x") for i in range(rows)]})
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=16)
    return table


def _served(srv, name: str) -> dict[int, str]:
    loader = Loader(name, servers=srv.address, batch_size=4, seed=0, epoch=0, format="numpy")
    try:
        return {int(i): str(t) for b in loader.batches() for i, t in zip(b.data["id"], b.data["text"])}
    finally:
        loader.close()


def test_small_chunks_of_rows_are_encoded_on_the_loop_and_large_ones_in_the_cpu_pool(serve_inprocess,
                                                                                  tmp_path: Path) -> None:
    small = _write(tmp_path / "small.arrow", 64, 1000)
    large = _write(tmp_path / "large.arrow", 12, ENCODE_ON_LOOP_BYTES + 1000)  # any chunk of them is over
    srv = serve_inprocess(datasets=[f"small={tmp_path / 'small.arrow'}", f"large={tmp_path / 'large.arrow'}"])
    assert encodes_in_executor(srv, "small", 4) == (64, 0)  # 4 KB chunks: none went to the pool
    n, encodes = encodes_in_executor(srv, "large", 4)
    assert n == 12 and encodes >= 3  # a batch of 4 whole: each chunk went to the pool
    # Either way the rows arrive as written.
    for name, table in (("small", small), ("large", large)):
        assert _served(srv, name) == dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
