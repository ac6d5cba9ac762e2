"""The job spec every process of a run shares, and resolving its ``MODULE:FUNC``
model and data specs, with one-line errors."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from protocol.model.options import TOKENS_PREFIX, RecipeError
from protocol.model.recipe import Recipe, RecipeFields, recipe_of

BUILTIN_MODELS = {"gpt": "zoo.gpt:gpt", "gpt2": "zoo.gpt:gpt2", "branchy": "zoo.branchy:branchy"}
BUILTIN_DATA = {"stdlib": "zoo.text:stdlib_text", "branchy": "zoo.branchy:branchy_data"}
#: the loader of ``--data tokens:DIR`` (``options.TOKENS_PREFIX``) and the shards' vocabulary
TOKENS_DATA = "zoo.tokens:token_batches"
TOKENS_VOCAB = "zoo.tokens:vocab_size"


class SpecError(ValueError):
    """A ``MODULE:FUNC`` spec that cannot be resolved; ``str()`` is one line."""


def resolve(spec: str, builtins: dict[str, str]) -> Callable[..., Any]:
    """Return the callable named by ``spec`` (a built-in name, ``pkg.mod:func`` or
    ``path/to/file.py:func``)."""
    spec = builtins.get(spec, spec)
    module_part, sep, func_name = spec.rpartition(":")
    if not sep or not module_part or not func_name:
        raise SpecError(f"'{spec}' is not MODULE:FUNC (e.g. mypkg.models:build or models.py:build)")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise SpecError(f"cannot load '{spec}': no file {path}")
        name = f"_fusionllm_user_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise SpecError(f"cannot load '{spec}': {path} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise SpecError(f"cannot load '{spec}': {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as exc:
            raise SpecError(f"cannot import '{module_part}' for '{spec}': {type(exc).__name__}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise SpecError(f"'{module_part}' has no callable '{func_name}'")
    return func


def foreign_code(spec: str) -> str | None:
    """The module (``pkg.mod`` or ``path/file.py``) a model spec makes a process import,
    or None for a built-in name (code that ships with FusionLLM)."""
    if spec in BUILTIN_MODELS:
        return None
    return spec.rpartition(":")[0] or spec


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """``"a=1,b=x,c=true"`` -> ``{"a": 1, "b": "x", "c": True}``."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"'{item}' is not KEY=VALUE")
        value: Any = raw.strip()
        if value.lower() in ("true", "false"):
            value = value.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(value)
                    break
                except ValueError:
                    pass
        out[key.strip()] = value
    return out


@dataclass(frozen=True)
class JobSpec(RecipeFields):
    """What every process of a run needs to rebuild the same model and data."""

    model: str = "gpt"
    model_args: str = ""
    data: str = "stdlib"
    data_args: str = ""
    seed: int = 0
    steps: int = 10
    micro_batches: int = 4
    init: str = ""  # a safetensors file of starting weights ('' : the seeded initialisation)
    eval_every: int = 0  # validation loss every N steps and after the last (0: never)
    eval_batches: int = 4  # validation batches per evaluation (the first of the held-out split)

    @classmethod
    def decode(cls, values: dict[str, Any]) -> JobSpec:
        """A job spec from its JSON fields (as an assignment carries them): unknown
        fields are ignored, a field of the wrong type is refused in one line."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            value, default = values[f.name], f.default
            if isinstance(default, tuple) and isinstance(value, list):
                value = tuple(value)
            ok = isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool))
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                ok, value = True, float(value)
            if not ok:
                raise SpecError(f"job field '{f.name}' is {type(value).__name__}, not {type(default).__name__}")
            kwargs[f.name] = value
        return cls(**kwargs)

    def recipe(self) -> Recipe:
        """The optimizer recipe (``SpecError``, one line, when it cannot train)."""
        try:
            return recipe_of(self, self.steps)
        except (RecipeError, TypeError) as exc:
            raise SpecError(f"optimizer recipe: {exc}") from None

    def model_factory(self) -> Callable[..., Any]:
        return resolve(self.model, BUILTIN_MODELS)

    def build_model(self) -> nn.Module:
        """The model with its initial weights: the same for every process with this spec."""
        factory = self.model_factory()
        kwargs = parse_kwargs(self.model_args)
        torch.manual_seed(self.seed)
        try:
            model = factory(**kwargs)
        except Exception as exc:
            raise SpecError(f"model '{self.model}' failed to build: {type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise SpecError(f"model '{self.model}' returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def checked_model(self) -> nn.Module:
        """The model, run once on the first micro-batch: a model that fails on its data,
        or returns anything but a scalar loss, is refused in one line."""
        model = self.build_model()
        self.check_vocab(model)
        try:
            with torch.no_grad():
                loss = model(*self.first_micro_batch())
        except SpecError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            data = f"the first micro-batch of data '{self.data}'"
            raise SpecError(
                f"model '{self.model}' fails on {data} at {_model_frame(exc)}: {type(exc).__name__}: {first}"
            ) from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise SpecError(f"model '{self.model}' must return its loss (a scalar tensor), got {type(loss).__name__}")
        return model

    def check_vocab(self, model: nn.Module) -> None:
        """Token shards name their tokenizer's vocabulary: the model's input embedding
        must have exactly that many rows (a model without one is not checked)."""
        if not self.data.startswith(TOKENS_PREFIX):
            return
        want = resolve(TOKENS_VOCAB, {})(self.data.removeprefix(TOKENS_PREFIX))
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is not None and embedding.num_embeddings != want:
            raise SpecError(
                f"model '{self.model}' has a vocabulary of {embedding.num_embeddings} tokens, but data '{self.data}' "
                f"was made by a tokenizer of {want}: pass --model-args vocab_size={want}"
            )

    def _data_factory(self) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The data factory and its keyword arguments (``tokens:DIR`` passes ``path``)."""
        kwargs = parse_kwargs(self.data_args)
        if self.data.startswith(TOKENS_PREFIX):
            return resolve(TOKENS_DATA, {}), {**kwargs, "path": self.data.removeprefix(TOKENS_PREFIX)}
        return resolve(self.data, BUILTIN_DATA), kwargs

    def batches(self, split: str | None = None, start: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        """The run's batches in order (each a tuple of tensors), from batch ``start``: a
        factory that takes ``start`` begins there, any other is read past the first ones."""
        factory, kwargs = self._data_factory()
        if split is not None:
            kwargs["split"] = split
        skip = start
        if start and _takes_start(factory):
            kwargs["start"], skip = start, 0
        try:
            it = iter(factory(self.seed, **kwargs))
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(f"data '{self.data}' failed: {type(exc).__name__}: {exc}") from None
        for batch in itertools.islice(it, skip, None):
            if isinstance(batch, torch.Tensor):
                batch = (batch,)
            if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
                raise SpecError(f"data '{self.data}' must yield tuples of tensors, got {type(batch).__name__}")
            yield tuple(batch)

    def eval_due(self, steps_done: int) -> bool:
        """Whether the model after ``steps_done`` steps is evaluated."""
        return self.eval_every > 0 and (steps_done % self.eval_every == 0 or steps_done == self.steps)

    def eval_micro_batches(self) -> list[tuple[torch.Tensor, ...]]:
        """The validation set: the first ``eval_batches`` batches of the held-out split,
        each split like a training batch (so they fit the plan's shapes)."""
        out: list[tuple[torch.Tensor, ...]] = []
        for batch in itertools.islice(self.batches("val"), self.eval_batches):
            out.extend(split_batch(batch, self.micro_batches))
        if len(out) < self.eval_batches * self.micro_batches:
            raise SpecError(f"data '{self.data}' has fewer than {self.eval_batches} validation batches")
        return out

    def first_micro_batch(self) -> tuple[torch.Tensor, ...]:
        return split_batch(next(iter(self.batches())), self.micro_batches)[0]


def _takes_start(factory: Callable[..., Any]) -> bool:
    """Whether a data factory takes ``start`` (the first batch to yield)."""
    try:
        return "start" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


class ModelError(RuntimeError):
    """The model's own code raised while a stage ran it; ``str()`` is one line with the
    model's ``file:line`` and the exception."""


def model_error(exc: BaseException) -> ModelError:
    """``exc``, raised inside the model, as a one-line :class:`ModelError`."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return ModelError(f"the model fails at {_model_frame(exc)}: {type(exc).__name__}: {first}")


def _model_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the failure outside torch and this
    package: the model's own code."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    user = [f for f in frames if Path(f.filename).resolve() != Path(__file__).resolve()]
    frame = (user or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame is not None else "an unknown place"


def split_batch(batch: tuple[torch.Tensor, ...], micro_batches: int) -> list[tuple[torch.Tensor, ...]]:
    """Split a batch along dim 0 into ``micro_batches`` parts (sizes differ by at most one)."""
    size = batch[0].shape[0]
    if micro_batches < 1 or micro_batches > size:
        raise SpecError(f"cannot split a batch of {size} into {micro_batches} micro-batches")
    parts = [t.tensor_split(micro_batches, dim=0) for t in batch]
    return [tuple(p[i] for p in parts) for i in range(micro_batches)]


def mean_loss(losses: list[float]) -> float:
    """The loss of a set of micro-batches: their mean (training steps and validation)."""
    return sum(losses) / len(losses)
