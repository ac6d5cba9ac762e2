"""The ``hf:NAME[#CONFIG][:SPLIT][@COLUMN]`` input of ``fusionllm data prepare``,
parsed without importing anything (the parser checks it before numpy, torch or
``datasets``; ``zoo.hf_corpus`` opens it)."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "hf:"
SYNTAX = "hf:NAME[#CONFIG][:SPLIT][@COLUMN]"
DEFAULT_SPLIT = "train"
DEFAULT_COLUMN = "text"


@dataclass(frozen=True)
class HFSpec:
    name: str  # a hub name (owner/name) from the offline cache, or a local folder
    config: str | None = None
    split: str | None = None  # None: "train" (or a saved dataset's only table)
    column: str | None = None  # None: "text", or the only string column

    def __str__(self) -> str:
        return (
            f"{PREFIX}{self.name}{f'#{self.config}' if self.config else ''}{f':{self.split}' if self.split else ''}"
            f"{f'@{self.column}' if self.column else ''}"
        )


def is_hf(item: str) -> bool:
    return item.startswith(PREFIX)


def parse_hf(item: str) -> HFSpec:
    """``item``'s parts; ``ValueError`` (one line) where one is empty."""
    rest = item[len(PREFIX) :]
    rest, at, column = rest.rpartition("@") if "@" in rest else (rest, "", "")
    rest, colon, split = rest.rpartition(":") if ":" in rest else (rest, "", "")
    name, hash_, config = rest.partition("#")
    if not name.strip() or (at and not column) or (colon and not split) or (hash_ and not config):
        raise ValueError(f"{item}: not {SYNTAX} (an empty part)")
    return HFSpec(name, config or None, split or None, column or None)
