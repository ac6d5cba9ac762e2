"""A user model that records every process importing it (for the test that a peer
imports no model code it did not opt in to): each import appends its PID to the file
named by ``FUSIONLLM_IMPORT_MARKER``."""

from __future__ import annotations

import os

from torch import nn

from fusionllm.zoo import gpt

_MARKER = os.environ.get("FUSIONLLM_IMPORT_MARKER")
if _MARKER:
    with open(_MARKER, "a") as f:
        f.write(f"{os.getpid()}\n")


def build(**kwargs: object) -> nn.Module:
    return gpt(**kwargs)
