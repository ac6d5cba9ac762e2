"""The value types of the command line's flags: each reads one flag's text and raises
``argparse.ArgumentTypeError`` (one line, naming the value) for anything else. No
torch, numpy or hivemind here: parsing must answer at once."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from coordinator.plan_options import SCHEDULERS
from fusionllm.usage import positive_int
from protocol.model.options import RecipeError, parse_betas
from protocol.trust.admission import MAX_CERT_TTL_S, MIN_CERT_TTL_S

#: what ``--compression`` takes on a live swarm (``demo``, ``coordinator``)
COMPRESSION_MODES = ("none", "fp16", "bf16", "int8", "int4", "adatopk", "auto", "auto-lowrank")

positive = positive_int


def whole(text: str, low: int, high: int, what: str, bounds: str) -> int:
    """``text`` as an integer in [low, high]; ``what`` names it, ``bounds`` the range."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is not {bounds}")
    return value


def positive_float(
    text: str, what: str = "a number", bounds: str = "a positive, finite number", zero: bool = False
) -> float:
    """A finite number above 0 (or ``zero``: at least 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if not (0.0 <= value if zero else 0.0 < value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not {bounds}")
    return value


def natural(text: str) -> int:
    return whole(text, 0, 1 << 40, "a whole number", "at least 0")


def non_negative_float(text: str) -> float:
    return positive_float(text, bounds="a non-negative, finite number", zero=True)


def seconds(text: str) -> float:
    return positive_float(text, "a number of seconds", "a positive number of seconds")


def call_ms(text: str) -> float:
    value = positive_float(text, "a number of milliseconds", "a number of milliseconds from 0 to 1000", zero=True)
    if value > 1000:
        raise argparse.ArgumentTypeError(f"{value} is not a number of milliseconds from 0 to 1000")
    return value


def port(text: str) -> int:
    return whole(text, 0, 65535, "a port number", "a port (0-65535)")


def cert_ttl(text: str) -> int:
    low, high = int(MIN_CERT_TTL_S), int(MAX_CERT_TTL_S)
    return whole(text, low, high, "a whole number of seconds", f"between {low} and {high} seconds")


def rank(text: str) -> int:
    return whole(text, 1, 65536, "a whole number", "in [1, 65536]")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None


def chance(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a chance in [0, 1]")
    return value


def fraction(text: str) -> float:
    value = _number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def tolerance(text: str) -> float:
    """``compare --tol``: a finite number of at least 0."""
    value = _number(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite tolerance of at least 0")
    return value


def compression(text: str) -> str:
    if text not in COMPRESSION_MODES:
        raise argparse.ArgumentTypeError(f"'{text}' is not one of {', '.join(COMPRESSION_MODES)}")
    return text


def betas(text: str) -> tuple[float, float]:
    try:
        return parse_betas(text)
    except RecipeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rates(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of Mbit/s") from None
    if any(not r >= 0 or r == float("inf") for r in values):
        raise argparse.ArgumentTypeError(f"'{text}': rates must be finite and at least 0")
    return values


def schedulers(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(repr(b) for b in bad) or '(none)'}; choose from {', '.join(SCHEDULERS)}"
        )
    return list(dict.fromkeys(names))


def key_hex(text: str) -> str:
    from protocol.trust.identity import IdentityError, key_hex, public_key

    try:
        return key_hex(public_key(text.strip()))
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(f"'{text[:80]}' is not an Ed25519 public key in hex: {exc}") from None


def throttle(text: str) -> float:
    from peer.throttle import ThrottleError, parse_throttle

    try:
        return parse_throttle(text)
    except ThrottleError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def plot_path(text: str) -> str:
    """``sim --plot``: a .png that can be written, checked before a simulation of minutes."""
    target = Path(text).expanduser()
    if target.suffix != ".png":
        raise argparse.ArgumentTypeError(f"{text}: the plot is a .png file")
    if not target.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no folder {target.parent}")
    if target.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: a folder, not a file")
    writable = os.access(target.parent, os.W_OK | os.X_OK) and (not target.exists() or os.access(target, os.W_OK))
    if not writable:
        raise argparse.ArgumentTypeError(f"{text}: cannot write there (permission denied)")
    return text
