"""What the status page, ``/api/v1/state``, ``/metrics`` and ``fusionllm status``
show: a board the coordinator writes to and the HTTP side only reads.

The JSON schema (``StatusBoard.state()``), version 1 (revision 2: fields added,
none changed meaning):

- ``version``: 1; ``run_id``; ``phase``: waiting, planning, training, done or
  failed; ``started_at`` and ``now`` (unix seconds); ``message``: the last
  failure, if any.
- ``peers``: a list of objects with ``id``, ``device``, ``flops`` (advertised FLOP/s: its own benchmark),
  ``up_mbps``/``down_mbps`` (measured to the coordinator), ``connection``
  (``direct``; ``dial-out`` when the coordinator could not dial it back, so it
  dials the peers it works with; ``forwarded`` when its frames to another such
  peer pass through a reachable one; ``relayed``), ``stage`` and ``replica`` (null when the peer
  serves no stage), ``last_seen`` (unix seconds), ``health`` (advert freshness:
  ``ok``, ``late`` after 10 s of silence, ``silent`` after 30 s, ``left``) and
  ``state`` (its part in the run: ``joined`` when no plan has placed it yet,
  ``serving`` a stage, ``standby``, or ``lost`` after a failure, until a plan
  places it again or it is marked standby). Once it has trained: ``measured_flops``
  (its speed measured from its steps, what rebalancing plans with) and
  ``claim_contradicted`` (its advert claims over ``CLAIM_SLACK`` times that).
  *(revision 2: ``state``, ``measured_flops``, ``claim_contradicted``)*
- ``plan``: null before planning, else ``num_ops``, ``op_flops`` (FLOPs per op,
  in topological order), ``stages`` (``stage``, ``first_op``, ``last_op``,
  ``flops``, ``param_bytes``, ``peers``) and ``cuts`` (``boundary``, ``after_op``,
  ``bytes`` crossing per micro-batch, ``codec``, ``mbps`` measured).
- ``training``: ``step`` (steps done; it goes back on a rollback), ``steps``,
  ``epoch`` (the plan epoch, 0 before the first), ``loss`` (the last loss; after
  a rollback, the last one still on the chart), ``losses`` (``[step, loss]``
  pairs, at most 2,000, thinned evenly; a rollback drops the points it undoes),
  ``val_loss`` (the last validation loss, or null) and ``val_losses``
  (``[steps done, validation loss]`` pairs of ``--eval-every``),
  ``tokens_per_s`` (over the last 20 steps), ``elapsed_s``, ``eta_s``.
  *(revision 2: ``epoch``)*
- ``recovery``: ``epoch`` (as in ``training``), ``failures`` (peer failures
  reported), ``rollbacks``, ``steps_redone`` (steps undone by rollbacks, in
  all), ``spot_checks`` (micro-batches re-executed by another replica; a
  mismatch is an ``audit`` event). *(revision 2)*
- ``checkpoint``: null before the first, else the last one: ``step`` (the steps
  it holds; a resume continues there), ``path``, ``at`` (unix seconds),
  ``seconds`` (taken to write) and ``bytes``. *(revision 2)*
- ``links``: per stage boundary ``boundary``, ``codec``, ``mbps``,
  ``wire_bytes`` and ``raw_bytes`` (both directions, so far), ``ratio`` and
  ``path`` (``direct``; ``dial-out`` when peers on one side are behind NATs;
  ``forwarded`` when both are, through the coordinator).
- ``breakdown``: per stage, where its peers' step time goes: ``stage``,
  ``measured_ms`` (mean ms of each part of ``protocol.wire.step_parts.STEP_PARTS``
  and ``step``, over the peers' recent steps) and ``predicted_ms`` (the
  estimator's ``compute``, ``wire`` and ``step`` where it has them); refreshed
  every few steps. *(revision 3)*
- ``rejected``: counts of rejected messages by reason code.
- ``events``: ``{"t", "kind", "text"}``, oldest first: the last 50 ``rejected``,
  the last 20 ``checkpoint``, the last 20 ``check`` (a rebalance check's outcome,
  also when the plan is kept) and the last 200 of the other kinds, merged, so
  neither a flood of rejections nor routine events hide a failure. Kinds:
  join, leave, plan, links, epoch, failure, replace, rollback, checkpoint,
  resume, audit, rebalance, check, reshard (the adverts cut into more DHT
  shards), rejected, done and failed. *(revision 2: the separate histories and
  the kinds from epoch to resume, rebalance and check; reshard later)*
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

MAX_POINTS = 2000
LATE_S, SILENT_S = 10.0, 30.0
MAX_EVENTS = 200
# Kinds that come in floods (rejections) or routinely (a checkpoint every N steps) keep
# their own shorter histories, so they never push the rare ones (joins, plans, failures) out.
ROUTINE_EVENTS = {"rejected": 50, "checkpoint": 20, "check": 20}
MAX_REJECTED_EVENTS = ROUTINE_EVENTS["rejected"]
PEER_STATES = ("joined", "serving", "standby", "lost")
#: how far above its measured speed a peer's advertised FLOP/s may be before the page flags the claim: step
#: times include overheads a device benchmark does not (honest CPU peers on small models measure 3-6x lower)
CLAIM_SLACK = 10.0


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
        self.val_losses: list[list[float]] = []  # [steps done, validation loss]
        self._stride = 1  # keep every stride-th step once the chart is full
        self.step = 0
        self.last_loss: float | None = None
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=20)  # (seconds, tokens)
        self.train_started: float | None = None
        self.rejected: collections.Counter[str] = collections.Counter()
        self.epoch = 0
        self.failures = 0
        self.rollbacks = 0
        self.steps_redone = 0
        self.stages_as = ""  # "program" (ATen programs) or "code" (the model's Python, on peers that opted in)
        self.spot_checks = 0  # micro-batches re-executed by a replica (coordinator.auditing)
        self.last_checkpoint: dict[str, Any] | None = None
        self._seq = itertools.count()  # orders events across the two histories
        self.connections: dict[str, str] = {}  # peer id -> how it is reached, once dialled back
        self.breakdown: list[dict[str, Any]] = []  # per stage: where its step time goes (coordinator.breakdown)
        self._histories: dict[str, collections.deque[tuple[int, dict[str, Any]]]] = {
            kind: collections.deque(maxlen=n) for kind, n in {"": MAX_EVENTS, **ROUTINE_EVENTS}.items()
        }

    # ------------------------------------------------------------ writes
    def event(self, kind: str, text: str) -> None:
        history = self._histories.get(kind, self._histories[""])
        history.append((next(self._seq), {"t": self.clock(), "kind": kind, "text": text}))

    def saw_adverts(self, adverts: dict[str, Any]) -> None:
        """The live adverts (by peer id) at one poll of the DHT."""
        now = self.clock()
        for pid, ad in adverts.items():
            view = self.peers.get(pid)
            if view is None or view["health"] == "left":
                self.event("join", f"peer {pid} joined: {ad.device}, {ad.flops / 1e9:.1f} GFLOP/s")
                state = "lost" if view is not None and view["state"] == "lost" else "joined"
                view = self.peers[pid] = {"id": pid, "stage": None, "replica": None, "state": state}
            relayed = any("/p2p-circuit" in m for m in ad.maddrs)
            view.update(
                device=ad.device,
                flops=ad.flops,
                up_mbps=round(ad.up_mbps, 1),
                down_mbps=round(ad.down_mbps, 1),
                connection=self.connections.get(pid, "relayed" if relayed else "direct"),
                last_seen=now,
                health="ok",
            )
        for pid, view in self.peers.items():
            if pid not in adverts and view["health"] != "left":
                view["health"] = "left"
                self.event("leave", f"peer {pid} left: its advert expired")

    def set_connection(self, peer_id: str, kind: str) -> None:
        """How others reach a peer: ``direct``, ``dial-out`` (behind a NAT: it dials
        them) or ``forwarded`` (its frames pass through a reachable peer)."""
        self.connections[peer_id] = kind
        if peer_id in self.peers:
            self.peers[peer_id]["connection"] = kind

    def heard_from(self, peer_id: str) -> None:
        if peer_id in self.peers:
            self.peers[peer_id]["last_seen"] = self.clock()

    def measured(self, peer_id: str, flops: float) -> None:
        """A peer's speed as measured from its steps (``measured_flops``; its advert's
        claim stays in ``flops``)."""
        if peer_id in self.peers and math.isfinite(flops):
            view = self.peers[peer_id]
            view["measured_flops"] = flops
            view["claim_contradicted"] = view.get("flops", 0.0) > CLAIM_SLACK * flops

    def set_plan(
        self,
        op_flops: list[int],
        stages: list[dict[str, Any]],
        cut: list[int],
        boundary_bytes: list[int],
        groups: list[list[str]],
    ) -> None:
        """A plan (the first or a new epoch's): its peers serve, the other known
        peers stand by, except lost ones, which stay lost."""
        self.phase = "planning"
        placed = {pid: (s, r) for s, group in enumerate(groups) for r, pid in enumerate(group)}
        for pid, view in self.peers.items():
            if pid in placed:
                view.update(stage=placed[pid][0], replica=placed[pid][1], state="serving")
            else:
                view.update(stage=None, replica=None)
                if view["state"] != "lost":
                    view["state"] = "standby"
        self.plan = {
            "num_ops": len(op_flops),
            "op_flops": op_flops,
            "stages": [{**c, "stage": s, "peers": list(groups[s])} for s, c in enumerate(stages)],
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
            {
                "boundary": b,
                "codec": codec,
                "mbps": round(rate, 1),
                "wire_bytes": 0,
                "raw_bytes": 0,
                "ratio": 1.0,
                "path": self._path(b),
            }
            for b, (codec, rate) in enumerate(zip(codecs, mbps, strict=True))
        ]
        self.event(
            "links", ", ".join(f"boundary {b}: {c} at {r:.0f} Mbit/s" for b, (c, r) in enumerate(zip(codecs, mbps)))
        )
        self.phase = "training"
        if self.train_started is None:
            self.train_started = self.clock()

    def _path(self, boundary: int) -> str:
        """How boundary ``boundary``'s frames travel: ``forwarded`` when a pair of its peers
        are both behind NATs, ``dial-out`` when one side is, else ``direct``."""
        stages = self.plan["stages"] if self.plan is not None else []
        if boundary + 1 >= len(stages):
            return "direct"
        natted = [
            {p for p in stages[s]["peers"] if self.connections.get(p, "direct") != "direct"}
            for s in (boundary, boundary + 1)
        ]
        return "forwarded" if all(natted) else "dial-out" if any(natted) else "direct"

    def step_done(self, step: int, loss: float, seconds: float, tokens: int, traffic: list[tuple[int, int]]) -> None:
        """One finished step; ``traffic``: (wire, raw) bytes so far per boundary."""
        self.step = step + 1
        self.last_loss = loss
        self._recent.append((seconds, tokens))
        self._chart(step, loss)
        for link, (wire, raw) in zip(self.links, traffic, strict=False):
            link.update(wire_bytes=wire, raw_bytes=raw, ratio=round(raw / max(wire, 1), 2))

    def set_breakdown(self, rows: list[dict[str, Any]]) -> None:
        """Where each stage's step time goes (``coordinator.breakdown.StepBreakdown.table``)."""
        self.breakdown = rows

    def evaluated(self, steps_done: int, loss: float) -> None:
        """A validation loss of the model after ``steps_done`` steps."""
        self.val_losses.append([steps_done, round(loss, 5)])
        if len(self.val_losses) > MAX_POINTS:
            self.val_losses = self.val_losses[::2]

    def _chart(self, step: int, loss: float) -> None:
        if step % self._stride == 0:
            self.losses.append([step, round(loss, 5)])
            if len(self.losses) >= MAX_POINTS:
                self.losses = self.losses[::2]
                self._stride *= 2

    def reject(self, sender: str, code: str, detail: str) -> None:
        self.rejected[code] += 1
        self.event("rejected", f"from {sender}: {code}: {detail}")

    def finish(self, ok: bool, message: str = "") -> None:
        self.phase = "done" if ok else "failed"
        self.message = message
        self.event("done" if ok else "failed", message or f"{self.step} steps")

    # ------------------------------------------------------------ recovery
    def set_epoch(self, epoch: int, reason: str) -> None:
        """A new plan epoch begins; ``reason``: why the run re-planned."""
        self.epoch = epoch
        self.event("epoch", f"epoch {epoch}: {reason}")

    def peer_state(self, peer_id: str, state: str) -> None:
        """Mark a known peer ``joined``, ``serving``, ``standby`` or ``lost``; a
        peer that serves no more loses its stage. Unknown peers are ignored."""
        if state not in PEER_STATES:
            raise ValueError(f"peer state '{state}' is not one of {', '.join(PEER_STATES)}")
        view = self.peers.get(peer_id)
        if view is None:
            return
        view["state"] = state
        if state != "serving":
            view.update(stage=None, replica=None)

    def failure(self, peer_id: str, where: str, reason: str) -> None:
        """A peer failed (``where``: what it was doing, e.g. "step 12, stage 1")."""
        self.failures += 1
        self.peer_state(peer_id, "lost")
        self.event("failure", f"peer {peer_id} failed at {where}: {reason}")

    def replaced(self, stage: int, old: str, new: str) -> None:
        """``new`` serves ``stage`` in ``old``'s place (``old`` lost, or moved to standby)."""
        replica = None
        if self.plan is not None and 0 <= stage < len(self.plan["stages"]):
            group = self.plan["stages"][stage]["peers"]
            replica = group.index(old) if old in group else len(group)
            group[replica : replica + 1] = [new]
        old_view, new_view = self.peers.get(old), self.peers.get(new)
        if old_view is not None and old_view["state"] == "serving":
            self.peer_state(old, "standby")
        if new_view is not None:
            new_view.update(stage=stage, replica=replica, state="serving")
        self.event("replace", f"stage {stage}: peer {new} replaces {old}")

    def rollback(self, to_step: int, reason: str) -> None:
        """Training goes back to ``to_step`` (a checkpoint); the steps after it will be redone."""
        redone = max(0, self.step - to_step)
        self.rollbacks += 1
        self.steps_redone += redone
        self.step = to_step
        self.losses = [p for p in self.losses if p[0] < to_step]
        self.val_losses = [p for p in self.val_losses if p[0] <= to_step]
        self.last_loss = self.losses[-1][1] if self.losses else None
        self.event("rollback", f"back to step {to_step}, {redone} steps to redo: {reason}")

    def checkpoint(self, step: int, path: str, seconds: float, nbytes: int) -> None:
        """A checkpoint holding ``step`` steps was written to ``path``."""
        self.last_checkpoint = {
            "step": step,
            "path": path,
            "at": self.clock(),
            "seconds": round(seconds, 3),
            "bytes": nbytes,
        }
        self.event("checkpoint", f"step {step} saved to {path}: {nbytes / 1e6:.1f} MB in {seconds:.1f} s")

    def resumed(self, step: int, run_dir: str) -> None:
        """This coordinator restarted (``--resume``) from ``run_dir`` at ``step``."""
        self.step = step
        self.event("resume", f"coordinator resumed {run_dir} at step {step}")

    def restore_losses(self, losses: Iterable[float]) -> None:
        """The loss of each step so far (index = step), for a resumed coordinator's chart."""
        self.losses, self._stride, self.last_loss = [], 1, None
        for step, loss in enumerate(losses):
            self._chart(step, loss)
            self.last_loss = loss

    # ------------------------------------------------------------ reads
    @property
    def events(self) -> list[dict[str, Any]]:
        """All histories merged, oldest first."""
        return [e for _, e in heapq.merge(*self._histories.values(), key=lambda item: item[0])]

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
            "stages_as": self.stages_as,
            "training": {
                "step": self.step,
                "steps": self.steps,
                "epoch": self.epoch,
                "loss": self.last_loss,
                "losses": list(self.losses),
                "val_loss": self.val_losses[-1][1] if self.val_losses else None,
                "val_losses": list(self.val_losses),
                "tokens_per_s": round(toks / secs, 1) if secs > 0 else None,
                "elapsed_s": round(now - self.train_started, 1) if self.train_started else 0.0,
                "eta_s": round(per_step * (self.steps - self.step), 1) if per_step is not None else None,
            },
            "recovery": {
                "epoch": self.epoch,
                "failures": self.failures,
                "rollbacks": self.rollbacks,
                "steps_redone": self.steps_redone,
                "spot_checks": self.spot_checks,
            },
            "checkpoint": dict(self.last_checkpoint) if self.last_checkpoint else None,
            "links": [dict(link) for link in self.links],
            "breakdown": [dict(row) for row in self.breakdown],
            "rejected": dict(self.rejected),
            "events": self.events,
        }


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``: strict JSON that still says what went wrong."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value
