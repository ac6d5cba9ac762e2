"""How a message's fields are read from a JSON header: their types checked, numbers
widened where a float is due, unknown fields left to the caller. The message
classes and their registry are in ``protocol.wire.messages``."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


class MessageError(ValueError):
    """A header that is not a valid message of a known kind."""


@functools.cache
def fields_and_types(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """A message class's fields with their resolved types (resolving them per
    message cost a tenth of a millisecond on every frame a gate checks)."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def check_field(name: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # a JSON integer beyond any float
            raise MessageError(f"field '{name}' is out of range") from None
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise MessageError(f"field '{name}' must be {tp.__name__}, got {type(value).__name__}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise MessageError(f"field '{name}' must be a list")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [check_field(name, v, item_tp) for v in value]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise MessageError(f"field '{name}' must be an object")
        (_, value_tp) = typing.get_args(tp) or (str, Any)
        return {k: check_field(name, v, value_tp) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None) and value is None:
                return None
            try:
                return check_field(name, value, option)
            except MessageError:
                continue
        raise MessageError(f"field '{name}' has the wrong type")
    return value


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, not copied: ``dataclasses.asdict`` without its
    deep copy (a message's fields are JSON values, serialised at once; the copy was a
    third of the cost of sending a small message)."""
    return {name: getattr(obj, name) for name in _names(type(obj))}


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))
