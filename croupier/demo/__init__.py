"""`croupier demo`: the main job on an embedded dataset (the digits), end to end.

command (the CLI), data (writes the digits), procs (server and rank processes),
train (one rank's loop), model (the CNN and MLP), progress (bars and the summary).
"""

from croupier.demo.command import add_parser

__all__ = ["add_parser"]
