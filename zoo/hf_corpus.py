"""``hf:DATASET`` inputs of ``fusionllm data prepare``: a Hugging Face ``datasets``
table read offline, one row a document, in batches (the table stays memory-mapped).

``hf:NAME[#CONFIG][:SPLIT][@COLUMN]`` (``zoo.hf_spec``): NAME is a hub name from the
local cache (``owner/name``) or a local folder (``save_to_disk``'s, or one holding
parquet, json or csv files); SPLIT defaults to ``train``; COLUMN to ``text``, or the
only string column. ``datasets`` is imported only when a dataset is opened, with the
hub switched offline, so that a dataset not cached fails at once."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.hf_spec import DEFAULT_COLUMN, DEFAULT_SPLIT, HFSpec, parse_hf
from zoo.shards import ShardError

#: rows read at once while streaming a dataset's text column
BATCH_ROWS = 1024
INSTALL = "hf: inputs need Hugging Face datasets: pip install 'fusionllm[hf]' (or pip install datasets)"
OFFLINE_HOWTO = (
    "no network here: fetch it where there is one (huggingface-cli download --repo-type dataset NAME, "
    "or datasets.load_dataset(...).save_to_disk(DIR) and give hf:DIR), with HF_HOME pointing at the cache; "
    "data prepare reads datasets with HF_DATASETS_OFFLINE=1"
)


@dataclass(frozen=True)
class HFSource:
    """One opened dataset split: its rows, the text column and their UTF-8 bytes."""

    spec: HFSpec
    table: Any  # a datasets.Dataset
    column: str
    documents: int
    bytes: int

    @classmethod
    def open(cls, item: str) -> HFSource:
        try:
            spec = parse_hf(item)
        except ValueError as exc:
            raise ShardError(str(exc)) from None
        table = _load(spec)
        column = _text_column(spec, table)
        import pyarrow.compute as pc

        data = table.data.column(column)
        size = pc.sum(pc.binary_length(data)).as_py() or 0 if len(table) else 0
        return cls(spec, table, column, len(table), int(size))

    def texts(self) -> Iterator[str]:
        """Every row's text in order, ``BATCH_ROWS`` rows held at a time; a null is empty."""
        for batch in self.table.select_columns([self.column]).iter(batch_size=BATCH_ROWS):
            for text in batch[self.column]:
                yield text or ""


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ShardError(INSTALL) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def _load(spec: HFSpec) -> Any:
    ds = _datasets()
    folder = Path(spec.name).expanduser()
    saved = folder.is_dir() and any((folder / f).is_file() for f in ("dataset_dict.json", "state.json"))
    try:
        return _saved_split(ds, spec, folder) if saved else ds.load_dataset(spec.name, spec.config, split=_split(spec))
    except ShardError:
        raise
    except ValueError as exc:
        if "corresponds to no data" in str(exc):  # an empty file, or a split without rows
            raise ShardError(f"{spec}: the dataset is empty (no rows in {_split(spec)!r})") from None
        if "split" in str(exc).lower():
            raise ShardError(f"{spec}: no split {_split(spec)!r} ({_first_line(exc)})") from None
        raise ShardError(f"{spec}: cannot read it: {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001  # datasets raises many kinds; each is one line here
        if folder.exists():
            raise ShardError(f"{spec}: cannot read {folder} as a dataset: {_first_line(exc)}") from None
        raise ShardError(f"{spec}: not a local folder and not in the local cache; {OFFLINE_HOWTO}") from None


def _split(spec: HFSpec) -> str:
    return spec.split or DEFAULT_SPLIT


def _saved_split(ds: Any, spec: HFSpec, folder: Path) -> Any:
    """The split of a ``save_to_disk`` folder: one of a ``DatasetDict``, or its only table
    (whose own split, where it has one, must be the one asked for)."""
    state = folder / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files"):
        raise ShardError(f"{spec}: the dataset is empty (no rows)")
    table = ds.load_from_disk(str(folder))
    if isinstance(table, ds.DatasetDict):
        if _split(spec) not in table:
            raise ShardError(f"{spec}: no split {_split(spec)!r}; it has {', '.join(table) or 'none'}")
        return table[_split(spec)]
    own = str(table.split) if table.split is not None else None
    if spec.split is not None and spec.split != own:
        raise ShardError(f"{spec}: no split {spec.split!r}; {folder} holds one table ({own or 'unnamed'}): drop :SPLIT")
    return table


def _text_column(spec: HFSpec, table: Any) -> str:
    strings = [n for n, f in table.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    if spec.column is not None:
        if spec.column not in table.features:
            raise ShardError(f"{spec}: no column {spec.column!r}; it has {', '.join(table.features)}")
        if spec.column not in strings:
            raise ShardError(f"{spec}: column {spec.column!r} is not text ({table.features[spec.column]})")
        return spec.column
    if DEFAULT_COLUMN in strings:
        return DEFAULT_COLUMN
    if len(strings) == 1:
        return strings[0]
    found = ", ".join(strings) or "none"
    raise ShardError(f"{spec}: which column is the text? name it with @COLUMN (string columns: {found})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
