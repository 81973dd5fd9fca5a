"""Runner scripts: each runs inside its system's own environment (see _common.py)."""
