"""`croupier serve` with read groups off (groups of one): the hot path as it was before
server/stream/read_groups.py, for a side-by-side run of the same code otherwise.

    python -m croupier.bench.serve_ungrouped serve DATASET ... [serve flags]
"""

from __future__ import annotations

import sys

from croupier.cli import main
from croupier.server.stream import read_groups

if __name__ == "__main__":
    read_groups.READ_GROUP = 1
    sys.exit(main(sys.argv[1:]))
