"""Multiaddrs as the p2p daemon's client takes them."""

from __future__ import annotations

from multiaddr import Multiaddr

_P_P2P = 0x01A5


def strip_p2p(maddr: str) -> str:
    """The transport part of a multiaddr without ``/p2p/<id>``: the p2p daemon
    client cannot take hivemind's CID encoding of peer ids."""
    m = Multiaddr(maddr)
    try:
        return str(m.decapsulate_code(_P_P2P))
    except Exception:
        return maddr


def peer_id_of(maddr: str) -> str | None:
    """The peer id a multiaddr ends in (``/p2p/<id>``), if any."""
    try:
        return Multiaddr(maddr).value_for_protocol(_P_P2P)
    except Exception:
        return None
