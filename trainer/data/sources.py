"""Where prompt records come from: files, `datasets` folders and hub dataset ids.

    for where, record in read_records("data/math_train.parquet", split="train", limit=100): ...

A source is
- a file: `.jsonl` (one JSON object per line; errors name file:line), `.json` (a list of
  objects, or an object holding one under the split's name / `data` / `rows`), `.parquet`
  (pyarrow), `.csv` (a header row; values are strings);
- a folder written by `datasets` (`Dataset.save_to_disk` / `DatasetDict.save_to_disk`; a
  DatasetDict gives the split);
- a Hugging Face hub dataset id (`org/name`, `org/name@revision`): its files come through
  `huggingface_hub.snapshot_download(repo_type="dataset")` (the HF cache, `HF_HOME`,
  `HF_HUB_OFFLINE=1` = the cache only) and are read by `datasets.load_dataset` on the snapshot
  folder (splits from the file names: `train-*.parquet`, `data/test.jsonl`, ...).
`datasets` and `pyarrow` are the `data` extra (installed by `make install`), imported lazily.
"""

from __future__ import annotations

import csv
import importlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dllm.hub import is_repo_id, split_revision

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

log = logging.getLogger("dlrl.data")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


class DataError(ValueError):
    """A data source that cannot be read; the message names it."""


def _need(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DataError(f"reading this data needs `{module}` (pip install 'dlrl[data]'; make install installs "
                        f"it): {e}") from None


def kind_of(spec: str) -> str:
    """file | datasets_folder | hub | "" (not a source)."""
    path = Path(spec)
    if path.is_file():
        return "file"
    if path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS):
        return "datasets_folder"
    if not path.exists() and is_repo_id(spec) and not spec.endswith(FILE_SUFFIXES):
        return "hub"
    return ""


def source_problem(spec: str) -> str:
    """"" when `spec` names a readable source (nothing is loaded), else what is wrong."""
    path = Path(spec)
    if kind_of(spec):
        if path.is_file() and path.suffix not in FILE_SUFFIXES:
            return f"{spec!r}: unknown file type {path.suffix!r} (known: {', '.join(FILE_SUFFIXES)})"
        return ""
    if path.is_dir():
        return f"{spec!r} is a folder but not one written by datasets' save_to_disk (no {DATASET_MARKERS[0]})"
    return f"no such file {spec!r} (a .jsonl/.json/.parquet/.csv file, a save_to_disk folder or a hub dataset id)"


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: bad JSON: {e.msg} (column {e.colno})") from e


def _json(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: bad JSON: {e.msg} (line {e.lineno})") from e
    if isinstance(data, dict):
        key = next((k for k in (split, "data", "rows", "examples") if isinstance(data.get(k), list)), None)
        if key is None:
            raise DataError(f"{path}: a JSON object must hold the records as a list under {split!r}, 'data' or "
                            f"'rows' (keys: {', '.join(map(str, data)) or 'none'})")
        data = data[key]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of records, got {type(data).__name__}")
    for i, record in enumerate(data):
        yield f"{path}: record {i + 1}", record


def _rows(rows: Iterable[Any], name: str) -> Iterator[tuple[str, Any]]:
    for i, record in enumerate(rows):
        yield f"{name}: row {i + 1}", record


def _split_of(dataset: Dataset | DatasetDict, split: str, name: str) -> Dataset:
    if isinstance(dataset, dict):  # a DatasetDict
        if split not in dataset:
            raise DataError(f"{name}: no split {split!r} (splits: {', '.join(dataset.keys())})")
        return dataset[split]
    return dataset


def _hub(spec: str, split: str) -> Iterator[tuple[str, Any]]:
    hub = _need("huggingface_hub")
    datasets = _need("datasets")
    repo, revision = split_revision(spec)
    try:
        folder = hub.snapshot_download(repo, repo_type="dataset", revision=revision)
    except Exception as e:  # offline without the cache, unknown repo, no network
        raise DataError(f"hub dataset {spec!r}: {type(e).__name__}: {e}") from None
    log.info("hub dataset %s resolved to %s", spec, folder)
    try:
        ds = datasets.load_dataset(folder, split=split)
    except ValueError as e:  # an unknown split names the known ones
        raise DataError(f"hub dataset {spec!r}: {e}") from None
    return _rows(ds, f"{spec} [{split}]")


def read_records(spec: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of the source; `where` names the file:line / row."""
    kind, path = kind_of(spec), Path(spec)
    problem = source_problem(spec)
    if problem:
        raise (FileNotFoundError if not path.exists() else DataError)(f"prompts: {problem}")
    if kind == "hub":
        yield from _hub(spec, split)
    elif kind == "datasets_folder":
        ds = _split_of(_need("datasets").load_from_disk(str(path)), split, spec)
        yield from _rows(ds, f"{spec} [{split}]")
    elif path.suffix == ".jsonl":
        yield from _jsonl(path)
    elif path.suffix == ".json":
        yield from _json(path, split)
    elif path.suffix == ".parquet":
        yield from _rows(_need("pyarrow.parquet").read_table(path).to_pylist(), str(path))
    else:
        with path.open(encoding="utf-8", newline="") as f:
            yield from _rows(csv.DictReader(f), str(path))
