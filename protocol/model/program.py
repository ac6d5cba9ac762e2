"""A stage as a program of ATen operators: what a peer runs instead of the model's
Python.

The coordinator traces each stage below autograd (``make_fx``) into a graph whose
every call is a ``torch.ops.<namespace>.<op>.<overload>`` (or taking an item of a
multi-output op's result), under the recipe's autocast, so the casts are in the
graph. The graph travels as JSON of a fixed, small vocabulary (node references,
numbers, strings, lists, dtypes, devices), with the stage's constant tensors. A
peer resolves each operator by name in the allowed namespaces only, refuses the
program before anything runs if one is outside them, and then checks the program
on the meta device against the shapes the plan says it takes. Nothing named by the
coordinator is imported: ``torch.ops.aten`` is the dispatcher's table of
operators already loaded.

This module holds the format (a :class:`Program` and its payload); making one is
``program_export``, rebuilding a stage from one ``program_load``, and checking one
before it runs ``program_check``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PROGRAM_FORMAT = 1
#: operator namespaces a peer runs unless told otherwise (``fusionllm join --allow-ops``)
DEFAULT_NAMESPACES = ("aten",)
MAX_PROGRAM_BYTES = 64 << 20


class ProgramError(ValueError):
    """A stage that cannot be sent or run as a program; ``str()`` is one line."""


@dataclass
class Program:
    """One stage's program: ``graph`` (JSON-able) and its constant tensors by name."""

    graph: dict[str, Any]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

    def operators(self) -> list[str]:
        """The operators it calls, each once, in first-use order."""
        seen: dict[str, None] = {}
        for node in self.graph.get("nodes", []):
            seen.setdefault(str(node.get("op")), None)
        return list(seen)

    def to_payload(self) -> list[torch.Tensor]:
        """The tensors a message carries: the graph as UTF-8 JSON bytes, then the constants."""
        body = json.dumps({**self.graph, "constants": list(self.constants)}, allow_nan=False).encode()
        return [torch.frombuffer(bytearray(body), dtype=torch.uint8), *self.constants.values()]

    @classmethod
    def from_payload(cls, values: Sequence[Any]) -> Program:
        """The program a message carried (``ProgramError`` when it is not one)."""
        if not values or not isinstance(values[0], torch.Tensor) or values[0].dtype != torch.uint8:
            raise ProgramError("the stage program is missing its graph")
        if values[0].numel() > MAX_PROGRAM_BYTES:
            raise ProgramError(f"the stage program's graph is over {MAX_PROGRAM_BYTES >> 20} MiB")
        try:
            graph = json.loads(bytes(values[0].cpu().numpy().tobytes()).decode())
        except RecursionError:
            raise ProgramError("the stage program's graph nests too deep") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProgramError(f"the stage program's graph is not JSON: {str(exc)[:200]}") from None
        if not isinstance(graph, dict) or graph.get("format") != PROGRAM_FORMAT:
            raise ProgramError(f"the stage program is not of format {PROGRAM_FORMAT}")
        names = graph.pop("constants", None)
        tensors = list(values[1:])
        if not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names):
            raise ProgramError("the stage program's constants do not match its tensors")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ProgramError("the stage program's constants are not all tensors")
        return cls(graph, dict(zip(names, tensors, strict=True)))


def flat_leaves(value: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    """(path, leaf) of a value that may nest tuples and lists (a ``torch.Size`` is a leaf)."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            yield from flat_leaves(v, (*path, i))
    else:
        yield path, value


def rebuild_values(value: Any, leaves: Iterator[Any]) -> Any:
    """``value``'s structure with its leaves taken in order from ``leaves``."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return type(value)(rebuild_values(v, leaves) for v in value)
    return next(leaves)


def restore_sizes(value: Any, enc: Any) -> Any:
    """``value`` (a graph's output) with the ``torch.Size`` values its encoding names
    (an fx graph cannot return one: it turns them into tuples)."""
    if isinstance(enc, dict) and len(enc) == 1:
        ((kind, items),) = enc.items()
        if kind == "size" and isinstance(value, tuple):
            return torch.Size(value)
        if kind in ("tuple", "list") and isinstance(value, (tuple, list)) and len(items) == len(value):
            return type(value)(restore_sizes(v, e) for v, e in zip(value, items, strict=True))
    return value
