"""What the driver knows of the model it trains: its OP-DAG, the example micro-batch,
the recipe, the starting weights, whether stages travel as ATen programs, each
stage's state names and programs for a cut, and the validation set.

:meth:`Stages.load` does the work (reads ``--init``, tries the export); the
constructor only keeps what it is given."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from coordinator.config import CoordinatorConfig
from coordinator.opdag import OpDag, build_opdag
from coordinator.outcome import SwarmError
from coordinator.weights import InitError, read_init
from protocol.model.graph import Cut, stage_modules
from protocol.model.job import JobSpec
from protocol.model.program import ProgramError
from protocol.model.program_export import export_stages
from protocol.model.recipe import Recipe
from protocol.trust.identity import SIGNATURE_BYTES
from protocol.wire.encoding import MAX_HEADER_BYTES, encode_values
from protocol.wire.envelope import HEAD
from protocol.wire.expect import match_values
from protocol.wire.reject import Rejected

logger = logging.getLogger(__name__)


class Stages:
    """The model's side of a run (pure: no network)."""

    def __init__(
        self,
        model: torch.nn.Module,
        job: JobSpec,
        example: tuple[torch.Tensor, ...],
        dag: OpDag,
        init_state: dict[str, torch.Tensor] | None,
        as_programs: bool,
    ) -> None:
        self.model = model
        self.job = job
        self.example = example
        self.dag = dag
        self.recipe: Recipe = job.recipe()
        #: stages travel as programs of ATen operators (peers import no model code), unless the model has an
        #: operation that cannot be traced to them; then peers build stages from the model's Python (--allow-code)
        self.as_programs = as_programs
        #: the starting weights peers get (``--init``'s; with programs, the model's own: peers cannot seed
        #: what they do not build), or None where peers seed their stages themselves
        self.init_state = model.state_dict() if as_programs and init_state is None else init_state
        self.param_order = [n for n, _ in model.named_parameters()]
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        #: one micro-batch of data: stage 0's input, which no operator of the DAG outputs
        self.input_bytes = sum(t.numel() * t.element_size() for t in example if isinstance(t, torch.Tensor))
        activations = sum(op.out_bytes for op in dag.ops) + self.input_bytes  # what any boundary carries, at most
        #: the most a peer's payload to the coordinator may take: a stage's state (weights, AdamW's two moments)
        #: or the evidence of poison (what one micro-batch carries across a boundary), with slack for the rest
        self.max_payload_bytes = max(3 * weights, 2 * activations) + (1 << 20)
        self._names: dict[tuple[int, ...], list[set[str]]] = {}
        self._programs: dict[tuple[int, ...], list[list[torch.Tensor]]] = {}
        self._frame_bytes: dict[tuple[int, ...], int] = {}
        self._eval_set: list[tuple[torch.Tensor, ...]] | None = None

    @classmethod
    def load(
        cls, model: torch.nn.Module, job: JobSpec, cfg: CoordinatorConfig, on_event: Callable[[str], None]
    ) -> Stages:
        """Trace ``model``, read ``--init`` (SwarmError if it does not fit) and see whether
        its stages export to ATen programs (``cfg.stages_as``)."""
        example = job.first_micro_batch()
        dag = build_opdag(model, example)
        init_state = None
        if job.init:
            try:
                init_state = read_init(job.init, model)
            except InitError as exc:
                raise SwarmError(str(exc)) from None
        as_programs = cfg.stages_as == "program" and _exportable(model, example, job.recipe(), on_event)
        return cls(model, job, example, dag, init_state, as_programs)

    def names(self, cut: Cut) -> list[set[str]]:
        """Each stage's state names (weights and buffers) under ``cut``."""
        if cut.boundaries not in self._names:
            _, modules = stage_modules(self.model, cut)
            self._names[cut.boundaries] = [set(m.state_dict()) for m in modules]
        return self._names[cut.boundaries]

    def programs(self, cut: Cut) -> list[list[torch.Tensor]]:
        """Each stage's program of ``cut``, as a message carries it (made once per cut)."""
        if cut.boundaries not in self._programs:
            programs = export_stages(self.model, cut, self.example, self.recipe)
            self._programs[cut.boundaries] = [p.to_payload() for p in programs]
        return self._programs[cut.boundaries]

    def frame_bytes(self, cut: Cut) -> int:
        """The most a frame into a stage of ``cut`` takes: its values (one micro-batch's
        across a boundary, forward or back, or of data into stage 0), twice over for a
        codec that sends more than the dense values, and a signed head at its largest
        (made once per cut)."""
        if cut.boundaries not in self._frame_bytes:
            values = max(*self.dag.boundary_bytes(cut), self.input_bytes, 0)
            self._frame_bytes[cut.boundaries] = 2 * values + HEAD.size + MAX_HEADER_BYTES + SIGNATURE_BYTES
        return self._frame_bytes[cut.boundaries]

    def restore_at(self, step: int) -> str:
        """How stages get the state of ``step``: the seeded initialisation at step 0, or
        a state the coordinator sends (a checkpoint's, or ``--init``'s)."""
        return "state" if step or self.init_state is not None else "init"

    def eval_micro_batches(self, specs: list[list[object]]) -> list[tuple[torch.Tensor, ...]]:
        """The validation set (held-out split), checked once against the plan's inputs."""
        if self._eval_set is None:
            mbs = self.job.eval_micro_batches()
            for m, mb in enumerate(mbs):
                try:
                    match_values(encode_values(list(mb))[0], specs[0], None)
                except Rejected as exc:
                    raise SwarmError(f"validation micro-batch {m} does not fit the plan: {exc.detail}") from None
            self._eval_set = mbs
        return self._eval_set


def _exportable(
    model: torch.nn.Module, example: tuple[torch.Tensor, ...], recipe: Recipe, on_event: Callable[[str], None]
) -> bool:
    """Whether the model traces to ATen operators (then every stage of every cut does)."""
    try:
        export_stages(model, Cut(()), example, recipe)
    except ProgramError as exc:
        on_event(f"stages run the model's own Python on the peers: {exc}")
        return False
    return True
