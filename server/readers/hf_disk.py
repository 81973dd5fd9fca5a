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
from typing import Any

from ..storage import Store, default_local_store
from .arrow_ipc import TableReader
from .base import DatasetError

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
DICT_FILE = "dataset_dict.json"


def is_hf_folder(store: Store, path: str) -> bool:
    """A save_to_disk folder of a Dataset or a DatasetDict (the latter is refused on open)."""
    return store.is_dir(path) and any(store.is_file(store.join(path, f)) for f in (STATE_FILE, INFO_FILE, DICT_FILE))


def _load_json(store: Store, path: str) -> Any:
    try:
        return json.loads(store.read_file(path))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{store.url(path)}: not a readable save_to_disk file: {exc}") from exc


def dataset_dict_error(store: Store, root: str) -> DatasetError:
    splits = _load_json(store, store.join(root, DICT_FILE)).get("splits") or [
        d for d in store.list_names(root)[0] if store.is_file(store.join(root, d, STATE_FILE))
    ]
    example = store.url(store.join(root, splits[0] if splits else "train"))
    return DatasetError(
        f"{store.url(root)} is a Hugging Face DatasetDict with splits {splits}; serve one split by pointing at "
        f"{store.url(root)}/<split>, e.g. {example}"
    )


def hf_data_files(store: Store, path: str) -> tuple[list[str], list[str] | None]:
    """The Arrow files of a save_to_disk folder, in order, and the columns its saved
    format keeps (None: all), as `load_from_disk` sees them; DatasetError naming the
    folder for a DatasetDict, an indices mapping, or files missing or outside it."""
    url = store.url(path)
    if store.is_file(store.join(path, DICT_FILE)):
        raise dataset_dict_error(store, path)
    if not store.is_file(store.join(path, STATE_FILE)):
        raise DatasetError(f"{url} is not a Dataset.save_to_disk folder: it has no {STATE_FILE}")
    state = _load_json(store, store.join(path, STATE_FILE))
    if state.get("_indices_data_files"):
        raise DatasetError(
            f"{url}: state.json lists an indices mapping ({state['_indices_data_files']}); "
            "load it, call Dataset.flatten_indices() and save_to_disk again"
        )
    names = [f.get("filename", "") for f in state.get("_data_files", [])]
    bad = [n for n in names if not n or "/" in n or "\\" in n or n in (".", "..")]
    if bad:
        raise DatasetError(f"{url}: state.json names data files outside its folder: {bad}")
    if not names:
        raise DatasetError(f"{url}: state.json lists no data files")
    files = [store.join(path, n) for n in names]
    missing = [store.url(f) for f in files if not store.is_file(f)]
    if missing:
        raise DatasetError(f"{url}: data files listed in state.json are missing: {missing}")
    columns = None if state.get("_output_all_columns", False) else state.get("_format_columns")
    return files, columns


class HFDiskReader(TableReader):
    format = "hf"

    def __init__(self, name: str, path: str, store: Store | None = None, **kwargs: Any):
        store = store if store is not None else default_local_store()
        files, columns = hf_data_files(store, path)
        super().__init__(name, path, files, columns=columns, store=store, **kwargs)
