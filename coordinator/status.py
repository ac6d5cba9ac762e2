"""What the status page, ``/api/v1/state``, ``/metrics`` and ``fusionllm status``
show: a board the coordinator writes to and the HTTP side only reads.

The JSON schema (``StatusBoard.state()``), version 1:

- ``version``: 1; ``run_id``; ``phase``: waiting, planning, training, done or
  failed; ``started_at`` and ``now`` (unix seconds); ``message``: the last
  failure, if any.
- ``peers``: a list of objects with ``id``, ``device``, ``flops`` (measured FLOP/s),
  ``up_mbps``/``down_mbps`` (measured to the coordinator), ``connection``
  (``direct`` or ``relayed``), ``stage`` and ``replica`` (null before the plan),
  ``last_seen`` (unix seconds) and ``health`` (``ok``, ``late`` after 10 s of
  silence, ``silent`` after 30 s, ``left``).
- ``plan``: null before planning, else ``num_ops``, ``op_flops`` (FLOPs per op,
  in topological order), ``stages`` (``stage``, ``first_op``, ``last_op``,
  ``flops``, ``param_bytes``, ``peers``) and ``cuts`` (``boundary``, ``after_op``,
  ``bytes`` crossing per micro-batch, ``codec``, ``mbps`` measured).
- ``training``: ``step`` (steps done), ``steps``, ``loss`` (the last loss),
  ``losses`` (``[step, loss]`` pairs, at most 2,000, thinned evenly),
  ``tokens_per_s`` (over the last 20 steps), ``elapsed_s``, ``eta_s``.
- ``links``: per stage boundary ``boundary``, ``codec``, ``mbps``,
  ``wire_bytes`` and ``raw_bytes`` (both directions, so far) and ``ratio``.
- ``rejected``: counts of rejected messages by reason code.
- ``events``: the last 200 of ``{"t", "kind", "text"}``, oldest first; kinds are
  join, leave, plan, links, rejected, done and failed.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

MAX_POINTS = 2000
LATE_S, SILENT_S = 10.0, 30.0


class StatusBoard:
    def __init__(self, run_id: str, steps: int, clock: Callable[[], float] = time.time) -> None:
        self.run_id = run_id
        self.steps = steps
        self.clock = clock
        self.started_at = clock()
        self.phase = "waiting"
        self.message = ""
        self.peers: dict[str, dict[str, Any]] = {}
        self.plan: dict[str, Any] | None = None
        self.links: list[dict[str, Any]] = []
        self.losses: list[list[float]] = []
        self._stride = 1  # keep every stride-th step once the chart is full
        self.step = 0
        self.last_loss: float | None = None
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=20)  # (seconds, tokens)
        self.train_started: float | None = None
        self.rejected: collections.Counter[str] = collections.Counter()
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)

    # ------------------------------------------------------------ writes
    def event(self, kind: str, text: str) -> None:
        self.events.append({"t": self.clock(), "kind": kind, "text": text})

    def saw_adverts(self, adverts: dict[str, Any]) -> None:
        """The live adverts (by peer id) at one poll of the DHT."""
        now = self.clock()
        for pid, ad in adverts.items():
            view = self.peers.get(pid)
            if view is None or view["health"] == "left":
                self.event("join", f"peer {pid} joined: {ad.device}, {ad.flops / 1e9:.1f} GFLOP/s")
                view = self.peers[pid] = {"id": pid, "stage": None, "replica": None}
            relayed = any("/p2p-circuit" in m for m in ad.maddrs)
            view.update(
                device=ad.device,
                flops=ad.flops,
                up_mbps=round(ad.up_mbps, 1),
                down_mbps=round(ad.down_mbps, 1),
                connection="relayed" if relayed else "direct",
                last_seen=now,
                health="ok",
            )
        for pid, view in self.peers.items():
            if pid not in adverts and view["health"] != "left":
                view["health"] = "left"
                self.event("leave", f"peer {pid} left: its advert expired")

    def heard_from(self, peer_id: str) -> None:
        if peer_id in self.peers:
            self.peers[peer_id]["last_seen"] = self.clock()

    def set_plan(
        self,
        op_flops: list[int],
        stages: list[dict[str, Any]],
        cut: list[int],
        boundary_bytes: list[int],
        groups: list[list[str]],
    ) -> None:
        self.phase = "planning"
        for s, group in enumerate(groups):
            for r, pid in enumerate(group):
                if pid in self.peers:
                    self.peers[pid].update(stage=s, replica=r)
        self.plan = {
            "num_ops": len(op_flops),
            "op_flops": op_flops,
            "stages": [{**c, "stage": s, "peers": groups[s]} for s, c in enumerate(stages)],
            "cuts": [
                {"boundary": b, "after_op": cut[b] - 1, "bytes": boundary_bytes[b], "codec": None, "mbps": None}
                for b in range(len(cut))
            ],
        }
        self.event("plan", f"{len(groups)} stages, cut after ops {[c - 1 for c in cut]}")

    def set_links(self, codecs: list[str], mbps: list[float]) -> None:
        if self.plan is not None:
            for c, codec, rate in zip(self.plan["cuts"], codecs, mbps, strict=True):
                c.update(codec=codec, mbps=round(rate, 1))
        self.links = [
            {"boundary": b, "codec": codec, "mbps": round(rate, 1), "wire_bytes": 0, "raw_bytes": 0, "ratio": 1.0}
            for b, (codec, rate) in enumerate(zip(codecs, mbps, strict=True))
        ]
        self.event(
            "links", ", ".join(f"boundary {b}: {c} at {r:.0f} Mbit/s" for b, (c, r) in enumerate(zip(codecs, mbps)))
        )
        self.phase = "training"
        self.train_started = self.clock()

    def step_done(self, step: int, loss: float, seconds: float, tokens: int, traffic: list[tuple[int, int]]) -> None:
        """One finished step; ``traffic``: (wire, raw) bytes so far per boundary."""
        self.step = step + 1
        self.last_loss = loss
        self._recent.append((seconds, tokens))
        if step % self._stride == 0:
            self.losses.append([step, round(loss, 5)])
            if len(self.losses) >= MAX_POINTS:
                self.losses = self.losses[::2]
                self._stride *= 2
        for link, (wire, raw) in zip(self.links, traffic, strict=False):
            link.update(wire_bytes=wire, raw_bytes=raw, ratio=round(raw / max(wire, 1), 2))

    def reject(self, sender: str, code: str, detail: str) -> None:
        self.rejected[code] += 1
        self.event("rejected", f"from {sender}: {code}: {detail}")

    def finish(self, ok: bool, message: str = "") -> None:
        self.phase = "done" if ok else "failed"
        self.message = message
        self.event("done" if ok else "failed", message or f"{self.step} steps")

    # ------------------------------------------------------------ reads
    def state(self) -> dict[str, Any]:
        now = self.clock()
        peers = []
        for view in self.peers.values():
            v = dict(view)
            if v["health"] != "left":
                quiet = now - v["last_seen"]
                v["health"] = "ok" if quiet < LATE_S else "late" if quiet < SILENT_S else "silent"
            peers.append(v)
        secs = sum(s for s, _ in self._recent)
        toks = sum(t for _, t in self._recent)
        per_step = secs / len(self._recent) if self._recent else None
        return {
            "version": 1,
            "run_id": self.run_id,
            "phase": self.phase,
            "message": self.message,
            "started_at": self.started_at,
            "now": now,
            "peers": sorted(peers, key=lambda p: (p["stage"] is None, p["stage"] or 0, p["replica"] or 0, p["id"])),
            "plan": self.plan,
            "training": {
                "step": self.step,
                "steps": self.steps,
                "loss": self.last_loss,
                "losses": list(self.losses),
                "tokens_per_s": round(toks / secs, 1) if secs > 0 else None,
                "elapsed_s": round(now - self.train_started, 1) if self.train_started else 0.0,
                "eta_s": round(per_step * (self.steps - self.step), 1) if per_step is not None else None,
            },
            "links": [dict(link) for link in self.links],
            "rejected": dict(self.rejected),
            "events": list(self.events),
        }
