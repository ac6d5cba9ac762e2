"""How long the 1F1B schedule lets a round trip between two stages show: the
micro-batches each stage holds in flight, and the round trips that the steady period
cannot hide (the estimator's, kept apart from its plan model)."""

from __future__ import annotations

import functools

import numpy as np


def windows(k: int, rounds: int) -> np.ndarray:
    """Micro-batches each of ``k`` stages holds in flight under 1F1B."""
    return np.minimum(k - np.arange(k), rounds)


def round_trips(one: list[float], there_and_back: list[float], rounds: int) -> list[float]:
    """Under 1F1B stage ``s`` starts a forward only after a backward once it holds
    ``w_s = min(k - s, rounds)`` micro-batches: the round trip from stage ``s`` to a
    later stage ``t`` and back carries only ``w_s - w_t + 1`` micro-batches (two across
    one link), so its latency shows unless the steady period is at least that round
    trip divided by that count. (Counting the fill's round trip again overstates a
    latency-bound pipeline by up to about 10%; the simulator has the exact figure.)"""
    k = len(one)
    if k < 2:
        return []
    stages = np.concatenate([[0.0], np.cumsum(one)])
    links = np.concatenate([[0.0], np.cumsum(there_and_back)])
    window = windows(k, rounds)
    s, t = _pairs_after(k)
    trips = stages[t + 1] - stages[s] + links[t] - links[s]
    return [float((trips / np.maximum(1, window[s] - window[t] + 1)).max())]


@functools.lru_cache(maxsize=256)
def _pairs_after(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of stages ``s < t`` of ``k`` (as two index arrays)."""
    return np.triu_indices(k, 1)
