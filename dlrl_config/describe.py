"""What `dlrl <command> --help` and `dlrl config show` print: the keys of a config section
(`section.key  TYPE = DEFAULT  # help`) and the resolved sections as YAML.

    print("\n".join(describe(TrainConfig, "train")))   #   train.num_steps  int = 60  # ...
    print(dump_yaml({"train": cfg}))                    # loads back through load_sections
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from dlrl_config import Config


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _comments(cls: type) -> dict[str, str]:
    """Trailing `# comment` of each field's line in the class bodies (the help of fields without
    a Field(description=...))."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass in (BaseModel, Config):
            continue
        try:
            lines = inspect.getsourcelines(klass)[0]
        except (OSError, TypeError):
            continue
        for line in lines:
            m = re.match(r"^\s{4}(\w+)\s*:[^#]*#\s*(.+?)\s*$", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def describe(cls: type[BaseModel], section: str) -> list[str]:
    """One line per key of a section: `section.key  TYPE = DEFAULT  help` (help: the field's
    description, else its comment in the source, else the class docstring's first line for none)."""
    notes = _comments(cls)
    rows = []
    for name, field in cls.model_fields.items():
        default = field.get_default(call_default_factory=True)
        text = field.description or notes.get(name, "")
        rows.append((f"{section}.{name}", _type_name(field.annotation), json_default(default), text))
    width = max((len(r[0]) for r in rows), default=0)
    return [f"  {k:<{width}}  {t} = {d}" + (f"  # {h}" if h else "") for k, t, d, h in rows]


def json_default(value: Any) -> str:
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def dump_yaml(sections: Mapping[str, BaseModel]) -> str:
    """The resolved sections as a YAML config file (loads back through load_sections); secrets
    (keys ending in `token`) are shown as "<set>"."""
    data = {name: sec.model_dump(mode="json") for name, sec in sections.items()}
    for values in data.values():
        for key in values:
            if key.endswith("token") and values[key]:
                values[key] = "<set>"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)
