"""Adverts validated at the door: a peer's claims are finite, positive and within
what any real machine has, and its addresses parse, before anything plans with
them. An advert is only a claim; measurements supersede it (see
``coordinator.rebalancing``)."""

from __future__ import annotations

import math

from multiaddr import Multiaddr

from protocol.wire.messages import Advert

#: the most any advert may claim: 1 EFLOP/s of compute, 1 Tbit/s of bandwidth, 1 PiB of memory
MAX_FLOPS = 1e18
MAX_MBPS = 1e6
MAX_MEMORY_BYTES = 1 << 50
#: at most this many listen addresses, each at most this long; device names at most this long
MAX_MADDRS = 16
MAX_TEXT = 256
#: a host digest is at most this many hex digits; a machine has at most this many cores
MAX_HOST = 64
MAX_CORES = 1 << 16


#: what an advert may say of its reachability (the coordinator plans by its own dial-back)
REACH_KINDS = ("", "direct", "nat")


def advert_problem(ad: Advert) -> str:
    """Why ``ad`` cannot be planned with, in one line ('' if it can)."""
    for name, value, top in (
        ("FLOP/s", ad.flops, MAX_FLOPS),
        ("upload Mbit/s", ad.up_mbps, MAX_MBPS),
        ("download Mbit/s", ad.down_mbps, MAX_MBPS),
    ):
        if not _in_range(value, top):
            return f"{name} {value!r} is not a finite number in (0, {top:g}]"
    if not 0 <= ad.memory_bytes <= MAX_MEMORY_BYTES:
        return f"memory {ad.memory_bytes} bytes is not in [0, {MAX_MEMORY_BYTES}]"
    if len(ad.device) > MAX_TEXT:
        return f"a device name of {len(ad.device)} characters"
    if not 1 <= len(ad.maddrs) <= MAX_MADDRS:
        return f"{len(ad.maddrs)} addresses (1 to {MAX_MADDRS} expected)"
    for text in ad.maddrs:
        if len(text) > MAX_TEXT or not _parses(text):
            return f"the address {text[:64]!r} is not a multiaddr"
    if len(ad.host) > MAX_HOST or not all(c in "0123456789abcdef" for c in ad.host):
        return f"a host digest {ad.host[:32]!r} that is not at most {MAX_HOST} hex digits"
    if not (0 <= ad.cores <= MAX_CORES and 0 <= ad.host_cores <= MAX_CORES):
        return f"{ad.cores} cores of {ad.host_cores} (each in [0, {MAX_CORES}])"
    if ad.reach not in REACH_KINDS:
        return f"reachability {ad.reach[:32]!r} is not one of {', '.join(map(repr, REACH_KINDS))}"
    return ""


def _in_range(value: float, top: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= top


def _parses(text: str) -> bool:
    try:
        Multiaddr(text)
    except Exception:  # the parser raises several kinds (ValueError, BinaryParseError, ...)
        return False
    return True
