"""Typed configs: pydantic models filled from one YAML file plus `key=value` overrides.

    class TrainConfig(Config):                       # one model per YAML section
        objective: Literal["tracerl", "dipo"] = "tracerl"
        num_steps: int = Field(60, ge=1)
    root = load_sections("configs/tiny.yaml", ["num_steps=5", "server.port=8001"],
                         {"train": TrainConfig, "task": ArithmeticTask}, primary="train")
    root["train"].num_steps      # 5

A YAML file holds one mapping per section (`model`, `task`, `sft`, `server`, `train`, `eval`,
`align`, `users`, `generate`).
It is read once per command (`load_sections`) and the typed sections are handed down.
Overrides are `section.key=value`, or `key=value` for the command's own (`primary`) section;
values are YAML scalars, and a comma-separated string fills a list field
(`servers=http://h1:8000,http://h2:8000`). Unknown sections, unknown keys, wrong types and
broken rules raise `ConfigError` naming the key (`train.num_steps: ...`); an unknown section
or key in a file also names the file, the line and the nearest known name
(`configs/x.yaml:41: unknown section 'trian' (did you mean 'train'?)`).

A leaf package (yaml and pydantic only; it imports no dlrl package): describe.py lists a
section's keys for `--help` and dumps the resolved config (`dlrl config show`); cli.py holds
what every command line shares (`--check`, the default config file, the pre-load checks).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

T = TypeVar("T", bound="Config")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


class Config(BaseModel):
    """Base of every config section: typed fields, unknown keys refused, `check()` for the
    rules that tie several fields together (raise ValueError("<section>.<key>: ...")).
    Sections whose `extra` is "ignore" are read-only views of another package's section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="after")
    def _run_check(self) -> Config:
        self.check()
        return self

    def check(self) -> None:
        """Cross-field rules (override in subclasses)."""

    def replace(self: T, **changes: Any) -> T:
        """A validated copy with `changes` applied."""
        return build(type(self), {**self.model_dump(), **changes})


# Every section any dlrl command reads from a config file (a file may hold the sections of several
# commands: configs/tiny.yaml feeds sft, serve, train and eval). Anything else is a typo.
KNOWN_SECTIONS = ("model", "task", "sft", "server", "train", "eval", "align", "users", "generate")


class ConfigFile(dict):
    """The sections of one YAML file, with where each section and key is (`where("train", "lr")`
    -> "configs/tiny.yaml:47")."""

    def __init__(self, data: dict[str, Any], path: Path, lines: dict[tuple[str, ...], int]) -> None:
        super().__init__(data)
        self.path, self.lines = path, lines

    def where(self, *keys: str) -> str:
        line = self.lines.get(tuple(keys))
        return f"{self.path}:{line}" if line else str(self.path)


def nearest(name: str, known: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest known name, or ''."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every top-level key and of every key inside a top-level mapping."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    lines: dict[tuple[str, ...], int] = {}
    if not isinstance(node, yaml.MappingNode):
        return lines
    for key, value in node.value:
        lines[(str(key.value),)] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            for sub, _ in value.value:
                lines[(str(key.value), str(sub.value))] = sub.start_mark.line + 1
    return lines


def read_yaml(path: str | Path) -> ConfigFile:
    """The file's sections; an unknown section is an error naming the file, the line and the
    nearest known section."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text()
        data = yaml.safe_load(text) or {}
        lines = _key_lines(text) if data else {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections")
    doc = ConfigFile(data, p, lines)
    for section in data:
        if section not in KNOWN_SECTIONS:
            raise ConfigError(f"{doc.where(str(section))}: unknown section {section!r}"
                              f"{nearest(section, KNOWN_SECTIONS)} (known: {', '.join(KNOWN_SECTIONS)})")
    return doc


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


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (list, tuple):
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))


def _message(e: ValidationError, section: str, origin: Mapping[str, str] | None = None,
             known: typing.Iterable[str] = ()) -> str:
    """One line per error; an error in a key read from a file starts with the file:line (`origin`:
    key -> where it was read); an unknown key gets the nearest of `known` (the section's keys)."""
    prefix = f"{section}." if section else ""
    parts = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        where = (origin or {}).get(str(err["loc"][0])) if err["loc"] else None
        at = f"{where}: " if where else ""
        if err["type"] == "extra_forbidden":
            parts.append(f"{at}unknown config key '{prefix}{key}'{nearest(key, known)}")
        elif key:
            parts.append(f"{at}config key {prefix}{key}: {msg} (got {err.get('input')!r})")
        else:
            parts.append(msg)
    return "\n".join(parts)


def build(cls: type[T], values: dict[str, Any], section: str = "", origin: Mapping[str, str] | None = None) -> T:
    """`cls` from a mapping; list fields also take a comma-separated string. ConfigError names the key
    (and, for the keys in `origin`, the file:line they were read from)."""
    values = dict(values)
    for name, field in cls.model_fields.items():
        if isinstance(values.get(name), str) and _is_list(field.annotation):
            values[name] = [v for v in values[name].split(",") if v]
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_message(e, section, origin, cls.model_fields)) from None


def load_section(cls: type[T], path: str | Path | None, section: str,
                 overrides: list[str] | None = None, bare_keys: bool = True) -> T:
    """One section of the YAML at `path` (None: defaults) with its overrides applied.
    `section.key=value` overrides always apply; bare `key=value` ones only when `bare_keys`."""
    data = read_yaml(path) if path else {}
    return _section(cls, data, section, overrides, bare_keys)


def _section(cls: type[T], data: dict[str, Any], section: str, overrides: list[str] | None,
             bare_keys: bool) -> T:
    raw = data.get(section) or {}
    where = data.where if isinstance(data, ConfigFile) else (lambda *k: "config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where(section)}: config section {section!r} must be a mapping")
    if cls.model_config.get("extra") != "ignore":  # views (extra="ignore") read a few keys of another's section
        for key in raw:
            if key not in cls.model_fields:
                raise ConfigError(f"{where(section, str(key))}: unknown config key '{section}.{key}'"
                                  f"{nearest(key, cls.model_fields)}")
    values = dict(raw)
    origin = {str(key): where(section, str(key)) for key in raw} if isinstance(data, ConfigFile) else {}
    for key, value in parse_overrides(overrides):
        if "." in key:
            sec, sub = key.split(".", 1)
            if sec != section:
                continue
        elif bare_keys:
            sub = key
        else:
            continue
        values[sub] = value  # an unknown key is refused by the model (extra="forbid")
        origin.pop(sub, None)  # the command line's value, not the file's
    return build(cls, values, section, origin)


def load_sections(path: str | Path | None, overrides: list[str] | None, sections: dict[str, type[Config]],
                  primary: str) -> dict[str, Config]:
    """Read the YAML once and build every section a command needs. Bare `key=value` overrides
    belong to `primary`; every override must name a field of a known section."""
    check_overrides(overrides, sections, primary)
    data = read_yaml(path) if path else {}
    return {name: _section(cls, data, name, overrides, bare_keys=name == primary)
            for name, cls in sections.items()}


def check_overrides(overrides: list[str] | None, sections: Mapping[str, type[BaseModel]], primary: str) -> None:
    """Raise unless every override names a field: `section.key` of a known section, or a
    bare `key` of the `primary` section (views with extra="ignore" take any key)."""
    for key, _ in parse_overrides(overrides):
        sec, sub = key.split(".", 1) if "." in key else (primary, key)
        cls = sections.get(sec)
        if cls is None:
            raise ConfigError(f"override {key!r}: unknown section {sec!r}{nearest(sec, sections)} "
                              f"(known: {', '.join(sections)})")
        if sub not in cls.model_fields and cls.model_config.get("extra") != "ignore":
            raise ConfigError(f"unknown config key '{sec}.{sub}'{nearest(sub, cls.model_fields)}")
