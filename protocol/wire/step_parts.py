"""The parts of a peer's step that ``StepDone.breakdown`` reports (``peer.timing``
measures them, ``coordinator.breakdown`` reads them). Seconds per part and ``"step"``,
the whole window; a receiver ignores parts it does not know."""

#: the version of ``StepDone.breakdown``'s layout that this code sends and reads
BREAKDOWN_V = 1
#: the parts of a peer's step (``StepDone.breakdown``), each a stretch of the step's timeline on the peer
#: (they do not overlap; ``other`` is what none of them covers): forward, backward and optimizer compute
#: (the optimizer with the gradient norms and the replicas' sum), encode (encoding, hashing and signing
#: what it sends, decoding and checking what it got), wire (from the first byte of an awaited message to its
#: delivery, verification included, and waiting for its own sends to drain), bubble (waiting for a
#: neighbour before the first byte of its message), commit (StepDone sent to Commit received), spot_checks
#: (keeping a step for its checks, and the compute thread busy with them), checkpoint (the state's snapshot
#: for an upload), eval (validation passes), handoff (handing work to the compute thread and back)
STEP_PARTS = (
    "forward",
    "backward",
    "optimizer",
    "encode",
    "wire",
    "bubble",
    "commit",
    "spot_checks",
    "checkpoint",
    "eval",
    "handoff",
    "other",
)
