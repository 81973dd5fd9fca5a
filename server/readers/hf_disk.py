"""Hugging Face `datasets` folders written by `Dataset.save_to_disk`, read with pyarrow.

Such a folder holds `state.json` (listing `_data_files`), `dataset_info.json` and the
Arrow stream files `data-0000k-of-0000N.arrow`. Row i of `load_from_disk(path)` is row
i of those files concatenated in the order state.json lists them, which is what this
reader serves, without going through `datasets` (whose per-row Python costs ~100 µs).

What a served row is, next to `load_from_disk(path)[i]`:
  * plain features (ints, floats, strings, lists, ClassLabel ids) are the same values;
  * a format saved with `set_format(columns=...)` restricts the columns here too; the
    format type (numpy, torch) is left to the client's collation;
  * features that `datasets` decodes on access (Image, Audio) travel as their stored
    Arrow value (a struct of bytes and path), decoded on the trainer side.
`save_to_disk` writes an indices mapping out (it flattens it); a folder that still lists
`_indices_data_files` is refused, since serving its data files would give other rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .arrow_ipc import TableReader
from .base import DatasetError

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
DICT_FILE = "dataset_dict.json"


def is_hf_folder(path: Path) -> bool:
    """A save_to_disk folder of a Dataset or a DatasetDict (the latter is refused on open)."""
    return path.is_dir() and any((path / f).is_file() for f in (STATE_FILE, INFO_FILE, DICT_FILE))


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: not a readable save_to_disk file: {exc}") from exc


def dataset_dict_error(root: Path) -> DatasetError:
    splits = _load_json(root / DICT_FILE).get("splits") or sorted(
        d.name for d in root.iterdir() if (d / STATE_FILE).is_file()
    )
    example = root / (splits[0] if splits else "train")
    return DatasetError(
        f"{root} is a Hugging Face DatasetDict with splits {splits}; serve one split by pointing at "
        f"{root}/<split>, e.g. {example}"
    )


class HFDiskReader(TableReader):
    format = "hf"

    def __init__(self, name: str, path: str):
        root = Path(path)
        if (root / DICT_FILE).is_file():
            raise dataset_dict_error(root)
        if not (root / STATE_FILE).is_file():
            raise DatasetError(f"{path} is not a Dataset.save_to_disk folder: it has no {STATE_FILE}")
        state = _load_json(root / STATE_FILE)
        if state.get("_indices_data_files"):
            raise DatasetError(
                f"{path}: state.json lists an indices mapping ({state['_indices_data_files']}); "
                "load it, call Dataset.flatten_indices() and save_to_disk again"
            )
        files = [root / f["filename"] for f in state.get("_data_files", [])]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DatasetError(f"{path}: data files listed in state.json are missing: {missing}")
        format_columns = state.get("_format_columns")
        if state.get("_output_all_columns", False):
            format_columns = None
        super().__init__(name, path, files, columns=format_columns)
