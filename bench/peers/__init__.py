"""croupier beside the loaders people choose for large shuffled remote data (issue 12).

    croupier bench --suite peers            # the issue's run (~25 min on 2 cores) -> peers.md / .json / .png
    croupier bench --suite peers --quick    # a couple of minutes on tiny data -> peers-quick.*
    python -m croupier.bench.peers [--quick] [--only TEXT] [--out DIR]

Modules: venvs (one virtual environment per peer), runners/ (a script per system, run in its
venv, printing JSON lines), case (running and watching one system's ranks), quality (the
delivered order's shuffle quality, Mosaic's entropy metric, resume accounting), suite (what
runs), report (Markdown and plots).
"""
