"""Hugging Face `datasets` folders written by `Dataset.save_to_disk`, read with pyarrow.

Such a folder holds `state.json` (listing `_data_files`), `dataset_info.json` and the
Arrow stream files; the rows a user gets from `load_from_disk(path)[i]` are row i of
those files concatenated, which is what this reader serves (without going through
`datasets`, whose per-row Python costs about 100 µs).
"""

from __future__ import annotations

import json
from pathlib import Path

from .arrow_ipc import TableReader
from .base import DatasetError


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file()


class HFDiskReader(TableReader):
    format = "hf"

    def __init__(self, name: str, path: str):
        root = Path(path)
        if (root / "dataset_dict.json").is_file():
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
            raise DatasetError(
                f"{path} is a DatasetDict with splits {splits}; serve one split, e.g. {root / (splits or ['train'])[0]}"
            )
        try:
            state = json.loads((root / "state.json").read_text())
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{root / 'state.json'}: not a readable save_to_disk state file: {exc}") from exc
        if state.get("_indices_data_files"):
            # save_to_disk flattens indices; a folder that still has a mapping was written
            # by hand or by an old version: refuse rather than serve the wrong rows.
            raise DatasetError(f"{path}: has an indices mapping; re-save it with Dataset.flatten_indices()")
        files = [root / f["filename"] for f in state.get("_data_files", [])]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DatasetError(f"{path}: data files listed in state.json are missing: {missing}")
        super().__init__(name, path, files)
