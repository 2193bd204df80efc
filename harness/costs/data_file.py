"""The measured-rates data files (harness/costs/measured_rates/*.json) read into frozen dataclasses,
checked field by field against the annotations, and written back; `RatesError` names the file and field."""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

MEASURED_RATES = Path(__file__).resolve().parent / "measured_rates"  # shipped as package data (pyproject.toml)

T = TypeVar("T")


class RatesError(ValueError):
    """A rates file that cannot be used; the message names the file and the field."""


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise RatesError(f"rates file {path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:
        raise RatesError(f"rates file {path}: not JSON ({err})") from None


def read_dataclass(cls: type[T], path: str | Path) -> T:
    """The file at `path` as a checked `cls`."""
    return build(cls, read_json(path), str(path))


def to_json(record: Any) -> str:
    return json.dumps(asdict(record), indent=1) + "\n"


def write_dataclass(record: Any, path: str | Path) -> Path:
    """Write atomically (a reader never sees half a file); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_json(record))
    os.replace(tmp, path)
    return path


def build(cls: type[T], data: Any, where: str, field_path: str = "") -> T:
    """`cls` from JSON, field by field against its annotations (str, int, float, nested dataclasses,
    tuples of them, dicts of them by name): missing, unknown and mistyped fields are errors naming the field."""
    if not isinstance(data, dict):
        raise RatesError(f"rates file {where}: {field_path or 'top level'}: expected an object, found {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise RatesError(f"rates file {where}: {field_path}{unknown[0]}: unknown field; expected one of {names}")
    values = {}
    for f in fields(cls):
        name = f"{field_path}{f.name}"
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:  # a required field
                raise RatesError(f"rates file {where}: {name}: missing")
            continue
        values[f.name] = _value(hints[f.name], data[f.name], where, name)
    return cls(**values)


def _value(tp: Any, value: Any, where: str, name: str) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        return None if value is None else _value(inner, value, where, name)
    if is_dataclass(tp):
        return build(tp, value, where, name + ".")
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, list):
            raise RatesError(f"rates file {where}: {name}: expected a list, found {value!r}")
        (item,) = {a for a in args if a is not Ellipsis}
        return tuple(_value(item, v, where, f"{name}[{i}]") for i, v in enumerate(value))
    if typing.get_origin(tp) is dict:  # keyed by name (JSON's keys are strings)
        if not isinstance(value, dict):
            raise RatesError(f"rates file {where}: {name}: expected an object, found {value!r}")
        return {k: _value(args[1], v, where, f"{name}.{k}") for k, v in value.items()}
    ok = {str: isinstance(value, str), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool)}[tp]
    if not ok:
        raise RatesError(f"rates file {where}: {name}: expected {tp.__name__}, found {value!r}")
    return float(value) if tp is float else value
