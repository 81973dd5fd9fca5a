"""croupier's Prometheus endpoint as the benchmarks and the fault harness read it."""

from __future__ import annotations

import urllib.request


def scrape(port: int, timeout: float = 10.0) -> list[tuple[str, str, float]]:
    """(name, labels as written between the braces or "", value) of every sample at
    127.0.0.1:`port`/metrics. Raises OSError when the server does not answer."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    samples = []
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        base, _, labels = name.partition("{")
        samples.append((base, labels[:-1] if labels.endswith("}") else labels, float(value)))
    return samples
