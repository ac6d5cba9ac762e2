"""A peer's side of spot checks (``protocol.trust.spotcheck``): for a step it finished
(before its ``Commit``, or after it while the next step trains, from what it held)
it shows the signed frames it received for a micro-batch (``Audit``), or
re-executes a replica's micro-batch from such frames and says whether the replica's
signed work matches (``Recheck``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from peer.executor import StageExecutor
from protocol.net.transport import Inbound
from protocol.trust.spotcheck import differs, fingerprint, loss_differs, seed_of, wrong_frame
from protocol.wire.codecs import Codec
from protocol.wire.encoding import Frame, Link, encode_values
from protocol.wire.gate import signed_frame
from protocol.wire.messages import Audit, Evidence, Recheck, Verdict


def as_evidence(inbound: Inbound) -> list[torch.Tensor]:
    """A received frame as evidence: its signed head and its payload, as uint8 tensors."""
    return [_bytes(inbound.head), _bytes(inbound.frame.payload)]


def _bytes(data: bytes | memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def evidence_for(
    msg: Audit, kept: dict[tuple[str, int], Inbound], state: dict[str, torch.Tensor] | None
) -> tuple[Evidence, list[torch.Tensor]]:
    """The answer to an ``Audit``: the kept frames it names (those this peer has), or
    the stage's weights and buffers (``weights``: ``state``, as they were in the
    audited step; none if this peer did not keep them)."""
    if msg.kinds == ["weights"]:
        if state is None:
            return Evidence(msg.run_id, msg.step, msg.mb, [], msg.epoch), []
        names = sorted(state)
        return Evidence(msg.run_id, msg.step, msg.mb, ["weights"], msg.epoch, names), [state[n] for n in names]
    kinds = [k for k in msg.kinds if (k, msg.mb) in kept]
    values = [t for k in kinds for t in as_evidence(kept[(k, msg.mb)])]
    return Evidence(msg.run_id, msg.step, msg.mb, kinds, msg.epoch), values


@dataclass
class Rechecker:
    """What a replica needs to re-execute a micro-batch of its stage."""

    ex: StageExecutor
    stage: int
    keys: dict[str, Any]  # peer id -> Ed25519 public key (the plan's peers and the coordinator)
    forward: Codec | None  # the codec of the activations this stage sends on (None: last stage)
    backward: Codec | None  # the codec of the gradients it sends back (None: first stage)
    divisor: int  # micro-batches per step

    def verdict(self, msg: Recheck, evidence: list[torch.Tensor], own_grads: Inbound | None) -> Verdict:
        """Re-execute ``msg``'s micro-batch and compare; ``own_grads`` is the suspect's
        signed ``ReplicaGrads`` of it, which this replica received during the step."""
        found = self._frames(msg, evidence)
        if isinstance(found, str):
            return Verdict(
                msg.run_id, msg.step, msg.mb, msg.suspect, False, f"bad evidence: {found}"[:400], msg.epoch, False
            )
        detail, computed = self._compare(msg, found, own_grads)
        return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, not detail, detail[:400], msg.epoch, True, computed)

    def _frames(self, msg: Recheck, evidence: list[torch.Tensor]) -> dict[str, tuple[Any, list[Any]]] | str:
        if len(evidence) != 2 * len(msg.roles):
            return f"{len(evidence)} evidence tensors for {len(msg.roles)} roles"
        if len(msg.signers) != len(msg.roles):
            return f"{len(msg.signers)} signers for {len(msg.roles)} roles"
        out = {}
        for i, (role, signer) in enumerate(zip(msg.roles, msg.signers, strict=True)):
            found = signed_frame(msg.run_id, signer, self.keys.get(signer), evidence[2 * i : 2 * i + 2])
            if found is None:
                return f"the {role} frame is not signed by {signer}"
            problem = wrong_frame(role, found[0], msg.run_id, msg.step, msg.mb, self.stage, msg.epoch)
            if problem:
                return problem
            out[role] = found
        return out

    def _compare(
        self, msg: Recheck, found: dict[str, tuple[Any, list[Any]]], own_grads: Inbound | None
    ) -> tuple[str, list[float]]:
        """What differs ('' if nothing) and, if something does, the fingerprint of what
        this re-execution computed (the coordinator compares it with another checker's)."""
        frames = {role: values for role, (_, values) in found.items()}
        out, grads_in, params = self.ex.replay(frames["input"], frames.get("grad_out"), self.divisor, msg.backward)
        computed: list[Any] = [out]
        if self.forward is None:
            problem = loss_differs(float(out), msg.loss, msg.tolerance)
        else:
            computed = _through(list(out), self.forward)
            problem = differs(computed, frames["output"], msg.tolerance)
            problem = problem and f"its activations: {problem}"
        if msg.backward:
            later = self._backward_differs(msg, found, (grads_in, params), own_grads, computed)
            problem = problem or later
        return problem, fingerprint(computed, seed_of(msg.step, msg.mb)) if problem else []

    def _backward_differs(
        self,
        msg: Recheck,
        found: dict[str, tuple[Any, list[Any]]],
        grads: tuple[list[Any], dict[str, torch.Tensor]],
        own_grads: Inbound | None,
        computed: list[Any],
    ) -> str:
        """What of the backward differs ('' if nothing); what it computed is added to
        ``computed`` (its fingerprint covers the whole re-execution)."""
        grads_in, params = grads
        problem = ""
        if "grad_in" in found and self.backward is not None and self.backward.lossless:
            sent_back = _through(grads_in, self.backward)
            computed += sent_back
            problem = differs(sent_back, found["grad_in"][1], msg.tolerance)
            problem = problem and f"its input gradients: {problem}"
        if msg.grads:
            computed += [params[n] for n in sorted(params)]
            if not problem:
                shown = found.get("param_grads")
                theirs = (list(shown[0].names), shown[1]) if shown else _named(own_grads)
                problem = _param_grads_differ(params, theirs, msg.tolerance)
        return problem


def _through(values: list[Any], codec: Codec) -> list[Any]:
    """``values`` as a receiver decodes them after ``codec`` (activations carry no
    error feedback, so a deterministic codec encodes them the same on every peer;
    the lossless one carries them unchanged, so they are not encoded at all)."""
    if codec.lossless:
        return [_on_cpu(v) for v in values]
    descs, chunks = encode_values(values, Link(codec))
    return Frame({"values": descs}, memoryview(bytearray(b"".join(bytes(c) for c in chunks)))).values()


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (tuple, list):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _named(own: Inbound | None) -> tuple[list[str], list[Any]] | None:
    return None if own is None else (list(own.message.names), own.values())  # type: ignore[attr-defined]


def _param_grads_differ(ours: dict[str, torch.Tensor], theirs: tuple[list[str], list[Any]] | None, rtol: float) -> str:
    if theirs is None:
        return "its parameter gradients of this micro-batch never arrived"
    names, values = theirs
    if sorted(names) != sorted(ours):
        return "its parameter gradients name other parameters"
    problem = differs([ours[n] for n in names], values, rtol)
    return problem and f"its parameter gradients: {problem}"
