"""Every message that crosses between FusionLLM processes, one frozen dataclass each.
Headers are JSON objects ``{"kind": ..., "v": PROTOCOL_VERSION, ...fields}``; decoding
ignores unknown fields (newer senders) and checks the known ones' types. Each class
says who sends it (``class Ready(Message, sender="peer")``): ``peer`` (to the
coordinator), ``coordinator`` (to a peer; ``early``: it may come before the peer holds
an assignment) or ``stage`` (a step's values between stages, and from the coordinator
into stage 0). Receivers take their kinds from :func:`kinds_from`, never their own lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.wire.assign_shape import check_assign
from protocol.wire.schema import MessageError, field_checks, fields_of

#: 2: ``Recheck.backward``. 3: ``Recheck.same_weights``. 4: DHT records under their signer's
#: key (hex) as the subkey, adverts name their run. 5: an ``Assign`` names its neighbourhood
#: only (``assign_shape``), a ``Recheck`` the keys of its signers. 6: ``reassign``, ``resend``. 7: ``mbs``
#: on ``Audit`` and ``Evidence`` (a holder's frames of several micro-batches in one answer).
PROTOCOL_VERSION = 7
#: who may send a message in a frame (a class that names none is a DHT record)
SENDERS = ("peer", "coordinator", "stage")

_REGISTRY: dict[str, type[Message]] = {}


def kinds_from(sender: str, early: bool = False) -> frozenset[str]:
    """The kinds of the messages ``sender`` (one of ``SENDERS``) sends; with ``early``,
    only those that may reach a peer before it holds an assignment."""
    if sender not in SENDERS:
        raise ValueError(f"no sender '{sender}': choose from {', '.join(SENDERS)}")
    return frozenset(k for k, c in _REGISTRY.items() if c.SENDER == sender and (c.EARLY or not early))


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""
    SENDER: ClassVar[str] = ""  # one of SENDERS ('' : not sent in frames)
    EARLY: ClassVar[bool] = False  # the coordinator may send it before the peer holds an assignment

    def __init_subclass__(cls, sender: str | None = None, early: bool | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if sender is not None:
            if sender not in SENDERS:
                raise TypeError(f"{cls.__name__}: sender '{sender}' is not one of {SENDERS}")
            cls.SENDER = sender
        if early is not None:
            cls.EARLY = early
        if cls.KIND:
            _REGISTRY[cls.KIND] = cls

    def header(self) -> dict[str, Any]:
        return {"kind": self.KIND, "v": PROTOCOL_VERSION, **fields_of(self)}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Message:
        """Decode any registered message from a header (unknown fields ignored)."""
        kind = header.get("kind")
        target = _REGISTRY.get(kind) if isinstance(kind, str) else None
        if target is None:
            raise MessageError(f"unknown message kind {kind!r}")
        version = header.get("v")
        if version != PROTOCOL_VERSION:
            raise MessageError(f"protocol version {version!r}, this peer speaks {PROTOCOL_VERSION}")
        kwargs = {}
        for name, check, required in field_checks(target):
            if name in header:
                kwargs[name] = check(name, header[name])
            elif required:
                raise MessageError(f"{kind} lacks field '{name}'")
        return target(**kwargs)


@dataclass(frozen=True)
class Advert(Message):
    """A peer's DHT record: who it is and what it measured. Refreshed before ``expires_at``."""

    KIND: ClassVar[str] = "advert"
    peer_id: str
    maddrs: list[str]
    device: str
    flops: float  # measured matmul FLOP/s in the training dtype
    memory_bytes: int
    up_mbps: float  # measured to the coordinator
    down_mbps: float
    torch_version: str
    protocol_version: int
    expires_at: float  # hivemind DHT time
    pubkey: str = ""  # Ed25519 public key (hex); the record is signed with it
    cert: dict[str, Any] = field(default_factory=dict)  # its admission certificate (a private swarm's DHT checks it)
    reach: str = ""  # the coordinator's dial-back: "direct", "nat" ("" before it knows; protocol.net.reach)
    host: str = ""  # a digest of its machine salted with the run (peers sharing one share its cores; "" unknown)
    cores: int = 0  # CPU threads its compute uses (0: unknown)
    host_cores: int = 0  # CPU cores of its machine (0: unknown)
    run_id: str = ""  # the run it is published for (every node's DHT rule refuses another run's)
    sig: str = ""


@dataclass(frozen=True)
class Assign(Message, sender="coordinator", early=True):
    """Coordinator -> peer: serve ``stage`` as replica ``replica``; names its neighbourhood (``assign_shape``)."""

    KIND: ClassVar[str] = "assign"
    run_id: str
    stage: int
    replica: int
    job: dict[str, Any]  # JobSpec fields
    cut: list[int]
    stages: list[list[str]]  # per stage: its peer ids in replica order, for the neighbourhood only ([] elsewhere)
    sizes: list[int]  # per stage: how many replicas serve it
    maddrs: dict[str, list[str]]  # peer id -> addresses (the neighbourhood's)
    schedule: str = "1f1b"
    keys: dict[str, str] = field(default_factory=dict)  # peer id -> Ed25519 public key (hex): the neighbourhood's
    specs: list[list[Any]] = field(default_factory=list)  # per stage: descriptions of its input values
    link_mbps: list[float] = field(default_factory=list)  # per stage boundary: pace sends to this rate (0: no pacing)
    epoch: int = 0  # the plan epoch this assignment starts
    start_step: int = 0  # the first step of the epoch: the stage's state must hold the updates of steps before it
    restore: str = "init"  # where that state comes from: RESTORE_MODES
    loss_scale: float = 1.0  # the loss scale of start_step (fp16; recipe.LossScale)
    pending_factor: float = 1.0  # the committed update of step start_step - 1, for a peer still to apply it
    pending_skip: bool = False
    program: bool = False  # the stage comes as a StageProgram (ATen operators), not from the job's model code
    certs: dict[str, float] = field(default_factory=dict)  # peer id -> when its admission certificate ends
    nat: list[str] = field(default_factory=list)  # neighbours no one can dial: they dial out (protocol.net.reach)

    def __post_init__(self) -> None:
        check_assign(self)


@dataclass(frozen=True)
class Ready(Message, sender="peer"):
    KIND: ClassVar[str] = "ready"
    run_id: str
    stage: int
    replica: int
    build_s: float
    next_mbps: dict[str, float] = field(default_factory=dict)  # peer id -> upload Mbit/s: next stage's, replicas'
    epoch: int = 0


@dataclass(frozen=True)
class Hello(Message, sender="peer"):
    """Peer -> coordinator, first message: binds the peer's Ed25519 key to the libp2p
    peer id that the stream authenticated."""

    KIND: ClassVar[str] = "hello"
    run_id: str
    pubkey: str
    again: bool = False  # sent after losing the coordinator or being evicted: the peer holds no stage
    proof: str = ""  # a private swarm's: admission.hello_proof of the swarm's secret
    maddrs: list[str] = field(default_factory=list)  # where it listens (the coordinator dials back its ports)


@dataclass(frozen=True)
class LinkPlan(Message, sender="coordinator"):
    """Coordinator -> peers after every peer is ready: the codec on each stage boundary."""

    KIND: ClassVar[str] = "links"
    run_id: str
    codecs: list[dict[str, Any]]  # per stage boundary: Codec.to_json()
    epoch: int = 0


@dataclass(frozen=True)
class Activations(Message, sender="stage"):
    """Forward values entering ``stage`` for one micro-batch (values in the frame)."""

    KIND: ClassVar[str] = "act"
    run_id: str
    step: int
    mb: int
    stage: int
    epoch: int = 0


@dataclass(frozen=True)
class Gradients(Message, sender="stage"):
    """Gradients of the values that ``stage`` sent forward for one micro-batch."""

    KIND: ClassVar[str] = "grad"
    run_id: str
    step: int
    mb: int
    stage: int
    epoch: int = 0


@dataclass(frozen=True)
class ReplicaGrads(Message, sender="stage"):
    """One replica's parameter gradients of one micro-batch of a step, by parameter
    name: replicas sum every micro-batch's gradients in micro-batch order, as
    autograd does in one process, so a replicated stage stays bitwise exact."""

    KIND: ClassVar[str] = "rgrad"
    run_id: str
    step: int
    stage: int
    replica: int
    names: list[str]
    epoch: int = 0
    mb: int = 0


@dataclass(frozen=True)
class StepDone(Message, sender="peer"):
    """A peer finished its part of a step (after its optimizer step)."""

    KIND: ClassVar[str] = "done"
    run_id: str
    step: int
    stage: int
    replica: int
    losses: dict[str, float] = field(default_factory=dict)  # micro-batch -> loss (last stage)
    compute_s: float = 0.0
    bytes_sent: dict[str, int] = field(default_factory=dict)  # destination peer -> bytes
    raw_sent: dict[str, int] = field(default_factory=dict)  # destination peer -> those bytes uncompressed
    epoch: int = 0
    grad_norms: dict[str, float] = field(default_factory=dict)  # parameter -> its unscaled gradient's 2-norm
    audit_s: float = 0.0  # compute seconds spent on spot checks (copies kept, re-executions) since its last StepDone
    #: where its time went since its last StepDone (``protocol.wire.step_parts``; breakdown_v 0: none sent)
    breakdown: dict[str, float] = field(default_factory=dict)
    breakdown_v: int = 0


@dataclass(frozen=True)
class Finish(Message, sender="coordinator", early=True):
    """Coordinator -> peer: the run is over; send your parameters and exit."""

    KIND: ClassVar[str] = "finish"
    run_id: str
    send_state: bool = True
    epoch: int = 0


@dataclass(frozen=True)
class State(Message, sender="peer"):
    """A stage's state_dict (tensors in the frame, names here)."""

    KIND: ClassVar[str] = "state"
    run_id: str
    stage: int
    names: list[str]
    epoch: int = 0
    step: int = 0  # the steps whose updates the state holds
    checkpoint: bool = False  # a periodic checkpoint (weights and optimizer state), not the run's end


@dataclass(frozen=True)
class PeerFailure(Message, sender="peer"):
    """A peer could not go on (e.g. its next stage is unreachable)."""

    KIND: ClassVar[str] = "failure"
    run_id: str
    stage: int
    reason: str
    epoch: int = 0
    suspect: str = ""  # the peer id the reporter could not reach, if that was the failure
    poison: bool = False  # the suspect sent values that are not finite (not: could not be reached)
    model: bool = False  # the model's own code raised (reason: its file:line and the exception)


#: how an ``Abort``'s reason begins when it answers a hello the coordinator refused (the rest says why)
NOT_ADMITTED = "not admitted: "


@dataclass(frozen=True)
class Abort(Message, sender="coordinator", early=True):
    """Coordinator -> peer: the run stopped (``reason``), or this peer is not admitted (``NOT_ADMITTED`` and why)."""

    KIND: ClassVar[str] = "abort"
    run_id: str
    reason: str


@dataclass(frozen=True)
class CoordinatorRecord(Message):
    """The coordinator's DHT record: where peers send their messages; ``shards``: how
    many the run's adverts are cut into (a peer's under ``adverts/<shard_of(its id,
    shards)>``); ``incarnation``: new at each start of its process (a peer that sees a
    new one says hello again: ``--resume`` restarts the same libp2p node)."""

    KIND: ClassVar[str] = "coordinator"
    peer_id: str
    maddrs: list[str]
    run_id: str
    expires_at: float
    shards: int = 1
    incarnation: str = ""
    pubkey: str = ""
    sig: str = ""


def dht_key(run_id: str, what: str) -> str:
    """DHT keys of a run: ``coordinator`` and the adverts' shards ``adverts/<i>``, each
    record under its signer's key (hex) as the subkey (``protocol.trust.run_records.RULES``)."""
    return f"fusionllm:{run_id}:{what}"


@dataclass(frozen=True)
class Release(Message, sender="coordinator", early=True):
    """Coordinator -> peer: everything you sent has arrived; you may leave."""

    KIND: ClassVar[str] = "release"
    run_id: str


#: where an assigned stage's state comes from: ``init`` (the seeded initial weights, only at step 0),
#: ``keep`` (what the peer holds: it must be at ``start_step``, or one step before it with that
#: step's gradients complete), ``state`` (a ``StageState`` frame from the coordinator follows)
RESTORE_MODES = ("init", "keep", "state")


@dataclass(frozen=True)
class Commit(Message, sender="coordinator"):
    """Coordinator -> peers: every peer finished ``step`` (but the first stage's one, where
    its report cannot change the update: ``coordinator.pipeline``); apply its optimizer
    update. Until then a step can be redone exactly (the update is not applied)."""

    KIND: ClassVar[str] = "commit"
    run_id: str
    step: int
    epoch: int = 0
    checkpoint: bool = False  # replica 0 of each stage then sends its state (weights and optimizer)
    factor: float = 1.0  # multiply the gradients by this before the update (the global clip)
    skip: bool = False  # do not update (fp16: the gradients were not finite)
    loss_scale: float = 1.0  # the next step's loss scale
    evaluate: int = 0  # then run this many validation micro-batches forward (EvalActivations)
    audit: bool = False  # keep this step's weights: its spot checks come while the next step trains


@dataclass(frozen=True)
class Audit(Message, sender="coordinator"):
    """Coordinator -> peer, after its ``StepDone`` of ``step`` (before its ``Commit``, or while the next step
    trains): send back the signed frames you received of micro-batch ``mb`` (``kinds``: ``act``, ``grad``,
    ``rgrad``; with ``mbs``: ``kinds[i]`` of micro-batch ``mbs[i]``) as they came: a spot check's evidence."""

    KIND: ClassVar[str] = "audit"
    run_id: str
    step: int
    mb: int
    kinds: list[str]
    epoch: int = 0
    mbs: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Evidence(Message, sender="peer"):
    """Peer -> coordinator: the frames an ``Audit`` asked for, each one's signed head and payload (two uint8
    tensors per kind, in ``kinds`` order; ``mbs``: their micro-batches); ``weights``: the stage's, by ``names``."""

    KIND: ClassVar[str] = "evidence"
    run_id: str
    step: int
    mb: int
    kinds: list[str]
    epoch: int = 0
    names: list[str] = field(default_factory=list)
    mbs: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Recheck(Message, sender="coordinator"):
    """Coordinator -> a replica of ``suspect``'s stage: re-execute micro-batch ``mb``
    of ``step`` from the signed frames in the payload (``roles`` of
    ``protocol.trust.spotcheck``; head and payload each) with this step's weights, and
    compare with what ``suspect`` signed and reported (``loss``, last stage), within
    ``tolerance`` (relative). An arbiter of another stage gets ``stage``, the ``weights``
    (by name, after the evidence) to rebuild it, and the signers' ``keys`` it may not hold."""

    KIND: ClassVar[str] = "recheck"
    run_id: str
    step: int
    mb: int
    suspect: str
    roles: list[str]
    signers: list[str]  # who signed each role's frame
    epoch: int = 0
    loss: float | None = None
    tolerance: float = 0.0
    stage: int = -1  # an arbiter's: the stage to rebuild (-1: the checker's own)
    weights: list[str] = field(default_factory=list)  # an arbiter's: the weights that follow the evidence
    program: int = 0  # an arbiter's: how many tensors of the stage's program follow the weights
    grads: bool = True  # compare parameter gradients (False: a stage of one peer, whose gradients no one else saw)
    backward: bool = True  # re-execute the backward too (False: the forward only; ``roles`` hold no gradients)
    same_weights: bool = False  # an arbiter's: no weights follow; those of its last arbitration (this stage and step)
    keys: dict[str, str] = field(default_factory=dict)  # an arbiter's: signer -> its Ed25519 public key (hex)


@dataclass(frozen=True)
class Verdict(Message, sender="peer"):
    """Replica -> coordinator: the result of a ``Recheck``; ``detail`` says what differed."""

    KIND: ClassVar[str] = "verdict"
    run_id: str
    step: int
    mb: int
    suspect: str
    agree: bool
    detail: str = ""
    epoch: int = 0
    checked: bool = True  # False: the evidence did not hold up, so nothing was compared
    computed: list[float] = field(default_factory=list)  # a disagreeing checker's fingerprint of its results


@dataclass(frozen=True)
class StageState(Message, sender="coordinator", early=True):
    """Coordinator -> peer: the state (weights and optimizer, by name, in the frame) its stage starts the epoch from."""

    KIND: ClassVar[str] = "stagestate"
    run_id: str
    stage: int
    names: list[str]
    epoch: int = 0
    step: int = 0


@dataclass(frozen=True)
class StageProgram(Message, sender="coordinator", early=True):
    """Coordinator -> peer: the program of ATen operators its assigned stage runs (``protocol.model.program``;
    the graph and constants in the frame), sent before the stage's state whenever the peer builds the stage."""

    KIND: ClassVar[str] = "program"
    run_id: str
    stage: int
    cut: list[int]
    epoch: int = 0


@dataclass(frozen=True)
class Reachability(Message, sender="coordinator", early=True):
    """Coordinator -> an admitted peer: whether it dialled the peer back (``protocol.net.reach``)."""

    KIND: ClassVar[str] = "reach"
    run_id: str
    direct: bool
    detail: str
    ports: list[int] = field(default_factory=list)  # the ports it tried


@dataclass(frozen=True)
class Certificate(Message, sender="coordinator", early=True):
    """Coordinator -> an admitted peer, on admission and each renewal: its signed admission certificate
    (``protocol.trust.admission``), and when planned peers' certificates now end (later senders are refused)."""

    KIND: ClassVar[str] = "cert"
    run_id: str
    cert: dict[str, Any]
    expires: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Beat(Message, sender="peer"):
    """Peer -> coordinator, every second while serving: alive, in ``epoch``, at ``step``."""

    KIND: ClassVar[str] = "beat"
    run_id: str
    step: int
    epoch: int = 0


@dataclass(frozen=True)
class Evict(Message, sender="coordinator", early=True):
    """Coordinator -> peer: you are not in the plan of ``epoch`` (you stalled, or your frames were
    from an older epoch); drop your stage and wait as a fresh standby."""

    KIND: ClassVar[str] = "evict"
    run_id: str
    reason: str
    epoch: int = 0


@dataclass(frozen=True)
class Standby(Message, sender="coordinator", early=True):
    """Coordinator -> peer: the plan of ``epoch`` does not use you; stay and wait."""

    KIND: ClassVar[str] = "standby"
    run_id: str
    epoch: int = 0


@dataclass(frozen=True)
class EvalActivations(Activations):
    """Forward values of validation micro-batch ``mb`` entering ``stage``, after the update of ``step``
    (values in the frame; no gradients follow)."""

    KIND: ClassVar[str] = "evalact"


@dataclass(frozen=True)
class EvalDone(Message, sender="peer"):
    """A last-stage peer's validation losses after the update of ``step``."""

    KIND: ClassVar[str] = "evaldone"
    run_id: str
    step: int
    stage: int
    replica: int
    losses: dict[str, float] = field(default_factory=dict)  # validation micro-batch -> loss
    epoch: int = 0
