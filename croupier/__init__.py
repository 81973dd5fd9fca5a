"""croupier: deal a globally shuffled dataset to trainer ranks, out of order.

Subpackages: `croupier.server` (the asyncio gRPC data server), `croupier.client`
(the trainer-side Loader and the RTP engine), `croupier.v1` (generated wire code).
"""

__version__ = "0.1.0"
