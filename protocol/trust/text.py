"""Peer-supplied text made safe to print: no terminal escapes, no reordering."""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls, DEL, and the bidi overrides that reorder what follows them.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: Any) -> str:
    """``text`` (much of it from peers) with every control character removed."""
    return _CONTROL.sub("", str(text))
