"""Typed configs: dataclasses filled from a YAML file plus `key=value` overrides.

    cfg = load_section(TrainConfig, "configs/tiny.yaml", "train", ["train.num_steps=5"])

A YAML file holds one mapping per section (`model`, `task`, `sft`, `server`, `train`).
Overrides are `section.key=value`, or `key=value` for the command's own section;
values are parsed as YAML scalars. Unknown keys and wrong types raise
`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections")
    return data


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out


def _coerce(name: str, typ: Any, value: Any) -> Any:
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if typ is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(name, a, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"config key {name!r}: {value!r} does not fit {typ}")
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = args[0] if args else Any
        return [_coerce(name, inner, v) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {name!r} must be a mapping, got {value!r}")
        return dict(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"config key {name!r} must be a bool, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"config key {name!r} must be an integer, got {value!r}")
        return int(value)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {name!r} must be a number, got {value!r}")
        return float(value)
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key {name!r} must be a string, got {value!r}")
        return str(value)
    return value


def build(cls: type[T], values: dict[str, Any], section: str = "") -> T:
    """Instantiate dataclass `cls` from a mapping, checking names and types."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{section}." if section else ""
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!r} (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in values.items()}
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check()
    return obj


def load_section(cls: type[T], path: str | Path | None, section: str,
                 overrides: list[str] | None = None, bare_keys: bool = True) -> T:
    """Read `section` of the YAML at `path` into `cls`, then apply overrides.

    `section.key=value` overrides always apply; bare `key=value` ones only when
    `bare_keys` (the section is the command's own: `train` for `dlrl train`, ...)."""
    data = dict(read_yaml(path).get(section) or {}) if path else {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in parse_overrides(overrides):
        if "." in key:
            sec, sub = key.split(".", 1)
            if sec == section:
                if sub not in names:
                    raise ConfigError(f"unknown config key {key!r}")
                data[sub] = value
        elif bare_keys and key in names:
            data[key] = value
    return build(cls, data, section)


def check_overrides(overrides: list[str] | None, sections: dict[str, type], primary: str) -> None:
    """Raise unless every override names a field: `section.key` of a known section, or a
    bare `key` of the `primary` section."""
    for key, _ in parse_overrides(overrides):
        sec, sub = key.split(".", 1) if "." in key else (primary, key)
        cls = sections.get(sec)
        if cls is None:
            raise ConfigError(f"override {key!r}: unknown section {sec!r} (known: {', '.join(sections)})")
        if sub not in {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(f"unknown config key {sec}.{sub!r}")


def print_check(command: str, *sections: Any) -> int:
    """`dlrl <command> --check`: the command line and config parsed and validated; print the
    resolved sections as one JSON line and return exit code 0 (errors exit 2 before this)."""
    import json

    out = {"command": command, "ok": True}
    for sec in sections:
        out[type(sec).__name__] = dataclasses.asdict(sec) if dataclasses.is_dataclass(sec) else str(sec)
    print(json.dumps(out, default=str))
    return 0
