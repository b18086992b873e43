"""A typed-YAML loader for dataclass configs: a file (strict: a key given twice is an error) and `key=value`
overrides, each value checked against its field's annotated type, choices and bounds (`_f`'s metadata), with one
line naming the key when it is wrong. Nothing here knows the run's keys: `gradient_analysis` reads its own schema
with it."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from utils.errors import ConfigError, UserError


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


@dataclasses.dataclass(frozen=True)
class CommandLineValue:
    """A `key=value` scalar from the command line: its YAML reading and its text. A string key takes the text
    (run_name=no, null, ~, 1.50 stay the strings the user typed; YAML would read a boolean, None or 1.5); any other
    key takes the reading."""

    value: Any
    text: str

    def for_type(self, tp: Any) -> Any:
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        options = [a for a in args if a is not type(None)]
        if self.value is None and len(options) < len(args):
            return None  # an optional key: null / ~ / nothing mean None
        if options == [str] and not isinstance(self.value, str):
            return self.text
        return self.value


def _coerce(key: str, value: Any, tp: Any, meta: dict[str, Any]) -> Any:
    """Check `value` against the annotated type `tp`; numeric strings like "2e-5" become floats."""
    if isinstance(value, CommandLineValue):
        value = value.for_type(tp)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
        return build_dataclass(tp, value, prefix=f"{key}.")
    if origin in (list,):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_tp, {}) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        mapping = next((a for a in options if dataclasses.is_dataclass(a)), None)
        if mapping is not None and isinstance(value, dict):  # e.g. a device given as {device: cpu, speed: 0.5}
            return build_dataclass(mapping, value, prefix=f"{key}.")
        tp = options[0]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
    elif tp is float:
        # PyYAML reads 2e-5 (no dot) as a string, and the authors' config quotes its learning rates.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(key, f"expected a finite number, got {value}")
    elif tp is str:
        if isinstance(value, bool) and ("off" if not value else "on") in (meta.get("choices") or ()):
            value = "on" if value else "off"  # YAML 1.1 reads a bare off / on as a boolean
        elif isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # run_name=2024: a name, written as a number
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
    choices = meta.get("choices")
    if choices and value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(key, f"'{value}' is not one of {', '.join(choices)}{extra}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(key, f"{value} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(key, f"{value} is above the maximum {meta['max']}")
    return value


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            extra = f"; did you mean '{prefix}{hint[0]}'?" if hint else ""
            raise ConfigError(f"{prefix}{key}", f"unknown key{extra}")
        kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key], dict(fields[key].metadata))
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - every field has a default
        raise ConfigError(prefix.rstrip(".") or "config", str(exc)) from None


def parse_overrides(overrides: list[str], keep_text: bool = False) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML, dotted keys for nested sections) into a nested dict.
    keep_text: each scalar as a CommandLineValue (its reading and its text), for the typed check to choose."""
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "command-line overrides must look like key=value")
        try:
            value = yaml.load(text, Loader=_PlainLoader) if text else ""
        except yaml.YAMLError:
            value = text
        if keep_text and (value is None or isinstance(value, (str, bool, int, float))):
            value = CommandLineValue(value, text)
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return result


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level of dotted keys, as overrides name them ({"a": {"b": 1}} -> {"a.b": 1})."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: str, line: int) -> None:
        super().__init__(f"duplicate key {key}")
        self.key, self.line = key, line


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's surprises for a config: no timestamps (run_name=2024-11-25 stays a string),
    no base-60 numbers (inject_fault=3:1 is not 181) and no leading-zero octals (007 stays a string)."""


_PlainLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:int",
                                                              "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_PlainLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0b[0-1_]+)$"), list("-+0123456789"))
_PlainLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
    r"|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


class _StrictLoader(_PlainLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKeyError(str(key), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_typed(schema: type, path: str | Path | None = None, overrides: list[str] | None = None,
               section: str | None = None) -> Any:
    """Read a YAML file (optional), apply overrides, validate everything into the dataclass `schema`.

    section: a top-level key whose mapping holds the settings, when present (the authors' gradient
    tool nests them under script_settings)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"--config: file not found: {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"--config: {path} is not UTF-8 text (byte {exc.start}: "
                              f"{exc.object[exc.start:exc.start + 1]!r})") from None
        except OSError as exc:
            raise UserError(f"--config: cannot read {path} ({exc.strerror})") from None
        try:
            loaded = yaml.load(text, Loader=_StrictLoader)
        except DuplicateKeyError as exc:
            raise ConfigError(exc.key, f"appears twice in {path} (line {exc.line}); keep one") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"--config: {path} is not valid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError(f"--config: {path} must hold a mapping of keys to values")
        raw = loaded or {}
        if section and isinstance(raw.get(section), dict):
            raw = raw[section]
    _deep_update(raw, parse_overrides(overrides or [], keep_text=True))
    return build_dataclass(schema, raw)

