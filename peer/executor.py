"""The stage executor: forward and backward of one stage's sub-graph per
micro-batch, and its optimizer. Transport-free, so one process can chain
executors and a peer can drive one from the network."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from protocol.model.job import model_error
from protocol.model.recipe import LossScale, Recipe, Update, autocast, initial_scale
from protocol.model.statecheck import Problems

#: Prefix of optimizer-state entries in a state snapshot: ``optim/<param name>/<state key>``.
OPTIM_PREFIX = "optim/"
#: The per-parameter state AdamW keeps once it has taken a step.
ADAMW_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


def make_optimizer(params: list[nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer:
    """The optimizer every stage and the reference use: AdamW with the recipe's betas
    and decoupled weight decay (on the parameters ``recipe.decays``).

    Per-parameter (``foreach=False``) so that a stage's optimizer does exactly what
    the whole model's would do to the same parameters.
    """
    decay = [p for p in params if recipe.decays(p.ndim)]
    rest = [p for p in params if not recipe.decays(p.ndim)]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=recipe.lr_at(0), betas=recipe.betas, foreach=False)


def scale_loss(loss: torch.Tensor, scale: LossScale, divisor: int) -> torch.Tensor:
    """What a micro-batch back-propagates: its loss times the loss scale, over the
    micro-batch count."""
    return loss * scale.scale / divisor if scale.scale != 1.0 else loss / divisor


def set_lr(optimizer: torch.optim.Optimizer, recipe: Recipe, step: int) -> None:
    """The scheduled learning rate for the update that ends step ``step``."""
    for group in optimizer.param_groups:
        group["lr"] = recipe.lr_at(step)


def unscale_and_norms(named: Sequence[tuple[str, nn.Parameter]], scale: LossScale) -> dict[str, float]:
    """Divide the gradients by the loss scale (in place) and return each one's 2-norm
    (fp32, as ``clip_grad_norm_`` takes it; inf or nan when it is not finite)."""
    out = {}
    inv = 1.0 / scale.scale
    for name, p in named:
        if p.grad is None:
            continue
        if inv != 1.0:
            p.grad.mul_(inv)
        out[name] = float(torch.linalg.vector_norm(p.grad.detach(), 2))
    return out


def finish_step(optimizer: torch.optim.Optimizer | None, params: Sequence[nn.Parameter], update: Update) -> None:
    """Apply a step's :class:`Update`: scale the gradients and step, or skip; clear them."""
    if optimizer is None:
        return
    if not update.skip:
        if update.factor != 1.0:
            factor = torch.tensor(update.factor, dtype=torch.float32)  # clip_grad_norm_'s fp32 coefficient
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.device))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _as_leaf(x: Any) -> Any:
    """A value as a fresh autograd leaf (tensors inside tuples and lists too)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(True) if x.is_floating_point() else x
    if type(x) in (tuple, list):
        return type(x)(_as_leaf(v) for v in x)
    return x


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if type(x) in (tuple, list):
        return type(x)(_detached(v) for v in x)
    return x


def _grad_of(x: Any) -> Any:
    """The gradient of a value: a tensor, a tuple of them, or None."""
    if isinstance(x, torch.Tensor):
        return x.grad if x.requires_grad else None
    if type(x) in (tuple, list):
        grads = tuple(_grad_of(v) for v in x)
        return grads if any(g is not None for g in grads) else None
    return None


def _pairs(out: Any, grad: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output tensor, its gradient) pairs of two values of the same structure."""
    if grad is None:
        return []
    if isinstance(out, torch.Tensor):
        if not isinstance(grad, torch.Tensor):
            raise ValueError(f"gradient of a tensor output is {type(grad).__name__}")
        return [(out, grad)] if out.requires_grad else []
    if type(out) in (tuple, list) and isinstance(grad, (tuple, list)) and len(grad) == len(out):
        return [p for o, g in zip(out, grad, strict=True) for p in _pairs(o, g)]
    raise ValueError(f"gradient structure does not match the output ({type(out).__name__})")


class StageExecutor:
    """Runs one stage. ``forward`` keeps what backward needs per micro-batch;
    ``backward`` frees it and returns the gradients of the stage's inputs."""

    def __init__(self, module: nn.Module, recipe: Recipe, is_last: bool, casts_inside: bool = False) -> None:
        """``casts_inside``: the module already holds the recipe's casts (a stage
        program traced under autocast), so it runs without autocast."""
        self.module = module
        self.casts_inside = casts_inside
        self.is_last = is_last
        self.recipe = recipe
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, recipe) if self.params else None
        self._saved: dict[int, tuple[list[Any], Any]] = {}
        self.steps_done = 0
        self.loss_scale = initial_scale(recipe)  # the current step's (the coordinator's word in a swarm)
        # where the stage runs: its weights', or its buffers' (a stage of a GPU peer may
        # hold no weights, only constants); the CPU for a stage of neither
        self.device = next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))

    @property
    def pending(self) -> int:
        """Micro-batches whose forward ran and whose backward has not."""
        return len(self._saved)

    def forward(self, mb: int, inputs: Sequence[Any]) -> Any:
        """Run the stage on ``inputs``; returns the output tuple (or the loss, last stage)."""
        if mb in self._saved:
            raise ValueError(f"micro-batch {mb} already ran forward on this stage")
        # Values may be tensors or (nested) tuples of them, e.g. the result of split().
        leaves = [_as_leaf(x) for x in inputs]
        out = self._run(leaves, grad=True)
        self._saved[mb] = (leaves, out)
        return self._outputs(out)

    def _run(self, leaves: list[Any], grad: bool) -> Any:
        """The stage's module on ``leaves``, recording for backward where ``grad``."""
        try:
            with torch.set_grad_enabled(grad), self._autocast():
                return self.module(*leaves)
        except Exception as exc:  # the model's own code: one line with its file:line
            raise model_error(exc) from None

    def _outputs(self, out: Any) -> Any:
        return out.detach() if self.is_last else tuple(_detached(o) for o in out)

    def backward(
        self, mb: int, grad_outputs: Sequence[torch.Tensor | None] | None, loss_divisor: int = 1
    ) -> list[torch.Tensor | None]:
        """Back-propagate micro-batch ``mb``: the last stage from its loss divided by
        ``loss_divisor``; others from ``grad_outputs``. Returns the inputs' gradients."""
        if mb not in self._saved:
            raise ValueError(f"micro-batch {mb} has no saved forward on this stage")
        leaves, out = self._saved.pop(mb)
        if self.is_last:
            roots, grads = [scale_loss(out, self.loss_scale, loss_divisor)], None
        else:
            assert grad_outputs is not None
            if len(grad_outputs) != len(out):
                raise ValueError(f"expected {len(out)} output gradients, got {len(grad_outputs)}")
            pairs = _pairs(tuple(out), tuple(grad_outputs))
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if roots:
            try:
                torch.autograd.backward(roots, grads)
            except Exception as exc:  # a custom autograd function of the model's
                raise model_error(exc) from None
        return [_grad_of(x) for x in leaves]

    def replay(
        self,
        inputs: Sequence[Any],
        grad_outputs: Sequence[torch.Tensor | None] | None,
        loss_divisor: int,
        backward: bool = True,
    ) -> tuple[Any, list[torch.Tensor | None], dict[str, torch.Tensor]]:
        """Forward and (with ``backward``) backward of one micro-batch again, exactly as
        ``forward`` and ``backward`` run it, leaving this step's saved forwards and
        gradients as they were: (outputs or loss, the inputs' gradients, the parameters'
        gradients; both empty without ``backward``). Without ``backward`` the forward
        records nothing for one (the same outputs, bit for bit; 5-9% less time on the
        demo's stages, and nothing held for a backward)."""
        if not backward:
            return self._outputs(self._run([_as_leaf(x) for x in inputs], grad=False)), [], {}
        saved, stash = self._saved, [(p, p.grad) for p in self.params]
        self._saved = {}
        try:
            for p in self.params:
                p.grad = None
            out = self.forward(-1, inputs)
            grads = self.backward(-1, grad_outputs, loss_divisor)
            own = {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}
        finally:
            self._saved = saved
            for p, g in stash:
                p.grad = g
        return out, grads, own

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The stage's weights and buffers as they are now, copied (by state-dict name)."""
        return {n: t.detach().clone() for n, t in self.module.state_dict().items()}

    @contextlib.contextmanager
    def holding(self, state: Mapping[str, torch.Tensor], scale: LossScale) -> Iterator[None]:
        """Run with ``state``'s weights and buffers (a :meth:`snapshot`) and loss scale
        in place of the current ones: the same tensors, their data swapped, and back on
        exit. Only between two uses on one thread: a forward saved for backward would
        see the other data. A ``state`` that lacks any of the stage's weights or saved
        buffers is refused (KeyError): nothing may run half on the current weights."""
        missing = self.not_covered(state)
        if missing:
            raise KeyError(f"the kept state lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        swapped, current_scale = [], self.loss_scale
        try:
            for name, t in tensors.items():
                if name in state and state[name] is not t:
                    swapped.append((t, t.data))
                    t.data = state[name]
            self.loss_scale = scale
            yield
        finally:
            for t, data in swapped:
                t.data = data
            self.loss_scale = current_scale

    def not_covered(self, state: Mapping[str, torch.Tensor]) -> list[str]:
        """The stage's weights and saved buffers that ``state`` has no tensor for (a
        snapshot of another stage, or of a stage cut differently)."""
        return sorted(set(self.module.state_dict()) - set(state))

    def evaluate(self, inputs: Sequence[Any]) -> Any:
        """The stage's forward in eval mode, without autograd (validation batches)."""
        self.module.eval()
        try:
            with torch.no_grad(), self._autocast():
                out = self.module(*inputs)
        finally:
            self.module.train()
        return out if self.is_last else tuple(out)

    def _autocast(self) -> Any:
        return contextlib.nullcontext() if self.casts_inside else autocast(self.recipe, self.device)

    def grad_norms(self) -> dict[str, float]:
        """Unscale this step's gradients and return each parameter's gradient norm by
        name (for the global clip and fp16's overflow check); call once per step,
        after the last backward."""
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        return unscale_and_norms(named, self.loss_scale)

    def step(self, update: Update | None = None) -> None:
        """End the step: apply ``update`` (default: plain) to the accumulated gradients
        and clear them; the next step's loss scale is the update's."""
        if self.optimizer is not None:
            set_lr(self.optimizer, self.recipe, self.steps_done)
        finish_step(self.optimizer, self.params, update or Update(scale=self.loss_scale))
        if update is not None:
            self.loss_scale = update.scale
        self.steps_done += 1

    def discard_step(self) -> None:
        """Forget a half-done step (saved forwards and gradients) so it can be redone."""
        self._saved.clear()
        self.module.zero_grad(set_to_none=True)

    def _param_names(self) -> dict[int, list[str]]:
        """id(parameter) -> its names; the first is the canonical (``named_parameters``) one."""
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return names

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """A snapshot of weights, buffers and optimizer state as contiguous CPU copies.

        Weights and buffers keep their ``state_dict`` names (the whole model's);
        optimizer state is ``optim/<param name>/<key>``. Safe to send or save while
        training goes on.
        """
        out = {k: _cpu_copy(v) for k, v in self.module.state_dict(keep_vars=True).items()}
        if self.optimizer is not None:
            names = self._param_names()
            for p, state in self.optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        out[f"{OPTIM_PREFIX}{names[id(p)][0]}/{key}"] = _cpu_copy(value)
        return out

    def select(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of ``tensors`` (e.g. a whole model's merged state) that belong to this stage."""
        own = set(self.module.state_dict(keep_vars=True))
        params = {name for aliases in self._param_names().values() for name in aliases}
        return {
            k: v for k, v in tensors.items() if k in own or (k.startswith(OPTIM_PREFIX) and _optim_param(k) in params)
        }

    def load_state_tensors(
        self, tensors: Mapping[str, torch.Tensor], *, strict_extra: bool = True, steps_done: int | None = None
    ) -> None:
        """Load a snapshot made by :meth:`state_tensors` (of this stage or of any cut of
        the same model, merged). Every weight and buffer must be present with its shape
        and dtype; keys of other stages raise unless ``strict_extra`` is false. Raises
        ``ValueError`` (one line) and changes nothing on a mismatch."""
        mine = self.select(tensors)
        problems = Problems()
        if strict_extra:
            problems.add("unexpected", [k for k in tensors if k not in mine])
        weights = {k: v for k, v in mine.items() if not k.startswith(OPTIM_PREFIX)}
        _check_weights(weights, self.module.state_dict(keep_vars=True), problems)
        optim_state = self._optim_state(mine, problems)
        if problems:
            raise ValueError(f"stage state does not match: {problems}")
        with torch.no_grad():
            self.module.load_state_dict(weights, strict=True)
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            sd["state"] = optim_state
            self.optimizer.load_state_dict(sd)
        if steps_done is not None:
            self.steps_done = steps_done

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (this stage's weights and buffers by ``state_dict`` name: what
        a suspect shows for a spot check) into the stage, in place; the optimizer's state
        is left alone. A fraction of :meth:`load_state_tensors`' cost, which rebuilds
        the optimizer's state as well. Raises ``ValueError`` (one line) and changes
        nothing on a mismatch."""
        current = self.module.state_dict(keep_vars=True)
        problems = Problems()
        problems.add("unexpected", [k for k in tensors if k not in current])
        _check_weights({k: v for k, v in tensors.items() if k in current}, current, problems)
        if problems:
            raise ValueError(f"stage state does not match: {problems}")
        with torch.no_grad():
            for k, t in current.items():
                t.copy_(tensors[k])

    def _optim_state(self, mine: Mapping[str, torch.Tensor], problems: Problems) -> dict[int, dict[str, Any]]:
        """The optimizer's per-parameter state (by index, as ``Optimizer.state_dict`` has it)."""
        if self.optimizer is None:
            return {}
        names = self._param_names()
        by_name: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in mine.items():
            if k.startswith(OPTIM_PREFIX):
                param, _, key = k[len(OPTIM_PREFIX) :].rpartition("/")
                by_name.setdefault(param, {})[key] = v
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                entries = next((by_name[n] for n in names[id(p)] if n in by_name), None)
                if entries is not None:
                    name = names[id(p)][0]
                    problems.add("incomplete optimizer state of", [name] if set(entries) != ADAMW_STATE_KEYS else [])
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in entries:
                            problems.check(f"{OPTIM_PREFIX}{name}/{key}", entries[key], p)
                    # private copies: the optimizer updates its state in place
                    state[index] = {key: v.detach().clone() for key, v in entries.items()}
                index += 1
        return state


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _optim_param(key: str) -> str:
    """The parameter name of an ``optim/<param>/<key>`` entry."""
    return key[len(OPTIM_PREFIX) :].rpartition("/")[0]


def _check_weights(
    weights: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], problems: Problems
) -> None:
    """Note in ``problems`` the stage's weights and buffers (``current``) that ``weights``
    lacks, and those it has with another shape or dtype."""
    problems.add("missing", [k for k in current if k not in weights])
    for k, v in weights.items():
        problems.check(k, v, current[k])
