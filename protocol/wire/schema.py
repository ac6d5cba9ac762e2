"""How a message's fields are read from a JSON header: their types checked, numbers
widened where a float is due, unknown fields left to the caller. The message
classes and their registry are in ``protocol.wire.messages``."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any


class MessageError(ValueError):
    """A header that is not a valid message of a known kind."""


@functools.cache
def fields_and_types(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """A message class's fields with their resolved types (resolving them per
    message cost a tenth of a millisecond on every frame a gate checks)."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


#: a field's check: (field name, JSON value) -> the value as the field holds it
Checker = Callable[[str, Any], Any]


@functools.cache
def checker(tp: Any) -> Checker:
    """The check of one field type, its shape read once (reading it on every field of
    every frame was most of a message's decoding)."""
    origin = typing.get_origin(tp)
    if tp is float:
        return _float
    if tp in (int, str, bool):
        return functools.partial(_plain, tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return functools.partial(_list, checker(item_tp))
    if origin is dict:
        (_, value_tp) = typing.get_args(tp) or (str, Any)
        return functools.partial(_dict, checker(value_tp))
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        others = tuple(checker(o) for o in options if o is not type(None))
        return functools.partial(_union, type(None) in options, others)
    return _anything


def _float(name: str, value: Any) -> Any:
    if type(value) is float:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # a JSON integer beyond any float
            raise MessageError(f"field '{name}' is out of range") from None
    return _plain(float, name, value)


def _plain(tp: type, name: str, value: Any) -> Any:
    if type(value) is tp:
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise MessageError(f"field '{name}' must be {tp.__name__}, got {type(value).__name__}")
    return value


def _list(item: Checker, name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise MessageError(f"field '{name}' must be a list")
    return [item(name, v) for v in value]


def _dict(item: Checker, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise MessageError(f"field '{name}' must be an object")
    return {k: item(name, v) for k, v in value.items()}


def _union(nullable: bool, options: tuple[Checker, ...], name: str, value: Any) -> Any:
    """The first of ``options`` that takes ``value``; None where the type allows it (and
    only None: a value that none of the others takes is refused)."""
    if value is None and nullable:
        return None
    for option in options:
        try:
            return option(name, value)
        except MessageError:
            continue
    raise MessageError(f"field '{name}' has the wrong type")


def _anything(name: str, value: Any) -> Any:
    return value


@functools.cache
def field_checks(cls: type) -> tuple[tuple[str, Checker, bool], ...]:
    """A message class's fields: (name, its check, whether a header must carry it)."""
    out = []
    for f, hint in fields_and_types(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, checker(hint), required))
    return tuple(out)


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, not copied: ``dataclasses.asdict`` without its
    deep copy (a message's fields are JSON values, serialised at once; the copy was a
    third of the cost of sending a small message)."""
    return {name: getattr(obj, name) for name in _names(type(obj))}


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))
