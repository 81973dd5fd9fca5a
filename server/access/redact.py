"""Server paths out of what clients see, unless the operator chose to disclose them.

A client needs a dataset's name, not where it lives: the server's folder layout (data
roots, mount points, user names in home folders) is the operator's business. Messages
keep the dataset's name and the member's path inside it: "/srv/data/digits/3/x.png"
becomes "<digits>/3/x.png"; a path under a data root "<data-root>/team-a/x.arrow"; any
other absolute path "<path>".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

# An absolute path (or file:// URL) not glued to a word, a scheme or another path.
_ABSOLUTE = re.compile(r"(?:file://)?(?<![\w.~:/>-])/[^\s'\"<>,;()\[\]{}]+")


class PathRedactor:
    def __init__(self, data_roots: Iterable[str] = (), disclose: bool = False):
        self.disclose = disclose
        self._prefixes: list[tuple[str, str]] = []
        for root in data_roots:
            self.add(root, "<data-root>")

    def add(self, path: str, label: str) -> None:
        """Show `path` (a dataset's folder or file, a data root) as `label`."""
        if not path or self.disclose:
            return
        path = path.rstrip("/") or "/"
        if all(p != path for p, _ in self._prefixes):
            self._prefixes.append((path, label))
            self._prefixes.sort(key=lambda p: -len(p[0]))  # the most specific first

    def dataset(self, name: str, path: str) -> None:
        # A one-file dataset is shown as "<name>/file.arrow": the file's own name tells the
        # user which file is at fault, and says nothing of where it lives.
        one_file = os.path.isfile(path) or (not os.path.isdir(path) and os.path.splitext(path)[1] != "")
        self.add(os.path.dirname(path) if one_file else path, f"<{name}>")

    def __call__(self, message: str, keep: str = "") -> str:
        """`message` without server paths; `keep` (what the client itself sent) stays as it is."""
        if self.disclose:
            return message
        for path, label in self._prefixes:
            # "/d/digits" must not eat the start of "/d/digits2".
            pattern = r"(?:file://)?" + re.escape(path) + r"(?![^/\s'\"<>,;()\[\]{}])"
            message = re.sub(pattern, lambda _m, label=label: label, message)
        return _ABSOLUTE.sub(lambda m: m.group(0) if keep and m.group(0) == keep else "<path>", message)

    def info_path(self, path: str) -> str:
        """DatasetInfo.path as clients see it: empty unless disclosed."""
        return path if self.disclose else ""
