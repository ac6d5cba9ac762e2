"""``fusionllm export RUN.safetensors --to gpt2-hf DIR`` (issue 30): Hugging Face's
``transformers`` loads the export as ``GPT2LMHeadModel`` and computes our model's
logits; ``--init`` reads it back bit for bit; every bad input is refused in one line
with exit code 2. ``transformers`` is imported inside the tests that need it only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from coordinator.weights import read_init
from fusionllm.local import save_state
from protocol.model.job import JobSpec
from tests.conftest import run_cli

CTX = 16
ARGS = f"n_layer=2,n_embd=32,n_head=4,block_size={CTX}"
#: (--model, --model-args): GPT-2 (tanh GELU), with its head tied, and the byte GPT with
#: a query/key/value bias (exact GELU)
SHAPES = {
    "gpt2": ("gpt2", ARGS),
    "gpt2-tied": ("gpt2", ARGS + ",tie_weights=true"),
    "gpt-qkv-bias": ("gpt", ARGS + ",qkv_bias=true"),
}


def _run_file(path: Path, model: str, model_args: str, seed: int = 1) -> nn.Module:
    """A run's weights as ``--save`` writes them, every tensor moved off its initial
    value (biases and norms too, so a misplaced or untransposed tensor shows)."""
    net = JobSpec(model=model, model_args=model_args).build_model()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_state(net, path)
    return net


def _export(run: Path, out: Path, model: str, model_args: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "export", str(run), "--to", "gpt2-hf", str(out), "--model", model, "--model-args", model_args, *extra
    )


def _our_logits(net: Any, idx: torch.Tensor) -> torch.Tensor:
    """The built-in GPT's forward up to the logits (its ``forward`` returns the loss)."""
    x = net.wte(idx) + net.wpe(torch.arange(idx.shape[1]))
    for block in net.blocks:
        x = block(x)
    return net.lm_head(net.ln_f(x))


def _hugging_face(folder: Path, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    """``GPT2LMHeadModel.from_pretrained(folder)``, offline, every tensor from the file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import GPT2LMHeadModel

    hf, info = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return hf.eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_transformers_loads_the_export_and_computes_our_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    model, model_args = SHAPES[shape]
    run, out = tmp_path / "run.safetensors", tmp_path / "hf"
    net = _run_file(run, model, model_args)
    r = _export(run, out, model, model_args)
    assert r.returncode == 0, r.stderr
    assert "exported" in r.stdout and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == (shape == "gpt2-tied")
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) == (shape != "gpt2-tied")
    hf = _hugging_face(out, monkeypatch)
    idx = torch.randint(0, 256, (3, CTX), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)
    with torch.no_grad():
        theirs, ours = hf(idx).logits, _our_logits(net, idx)
        assert (theirs - ours).abs().max().item() <= 1e-5
        loss = F.cross_entropy(theirs.reshape(-1, 256), targets.reshape(-1))
        assert float(net(idx, targets)) == pytest.approx(float(loss), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_export_then_init_round_trips_bit_for_bit(tmp_path: Path, shape: str) -> None:
    model, model_args = SHAPES[shape]
    run, out = tmp_path / "run.safetensors", tmp_path / "hf"
    _run_file(run, model, model_args, seed=5)
    assert _export(run, out, model, model_args).returncode == 0
    back = read_init(out / "model.safetensors", JobSpec(model=model, model_args=model_args).build_model())
    saved = load_file(str(run))
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[k], saved[k]) for k in saved)


def test_a_trained_run_exports_and_trains_on_from_its_export(tmp_path: Path) -> None:
    run, out, again = tmp_path / "run.safetensors", tmp_path / "hf", tmp_path / "again.safetensors"
    train = ["train", "--reference", "--model", "gpt2", "--model-args", ARGS, "--data-args", f"batch_size=4,ctx={CTX}"]
    r = run_cli(*train, "--steps", "2", "--threads", "1", "--save", str(run))
    assert r.returncode == 0, r.stderr
    r = run_cli("export", str(run), "--to", "gpt2-hf", str(out), "--model-args", ARGS)  # --model: gpt2 by default
    assert r.returncode == 0, r.stderr
    back = read_init(out / "model.safetensors", JobSpec(model="gpt2", model_args=ARGS).build_model())
    assert all(torch.equal(t, back[k]) for k, t in load_file(str(run)).items())
    r = run_cli(
        *train, "--steps", "1", "--threads", "1", "--init", str(out / "model.safetensors"), "--save", str(again)
    )
    assert r.returncode == 0, r.stderr


def test_force_writes_into_a_non_empty_folder_and_keeps_the_rest(tmp_path: Path) -> None:
    run, out = tmp_path / "run.safetensors", tmp_path / "hf"
    _run_file(run, "gpt2", ARGS)
    out.mkdir()
    (out / "README.md").write_text("mine\n")
    (out / "config.json").write_text("{}")
    r = _export(run, out, "gpt2", ARGS, "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "README.md").read_text() == "mine\n" and json.loads((out / "config.json").read_text())["n_layer"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def run_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "run.safetensors"
    _run_file(path, "gpt2", ARGS)
    return path


#: (what is wrong, the arguments after ``export`` with RUN and DIR as placeholders, the needle)
BAD: list[tuple[str, list[str], str]] = [
    ("missing file", ["NOPE", "--to", "gpt2-hf", "DIR", "--model-args", ARGS], "nope.safetensors: no such file"),
    ("not safetensors", ["JUNK", "--to", "gpt2-hf", "DIR", "--model-args", ARGS], "not a readable safetensors file"),
    (
        "too few layers",
        ["RUN", "--to", "gpt2-hf", "DIR", "--model-args", ARGS.replace("n_layer=2", "n_layer=3")],
        f"does not fit --model gpt2 --model-args {ARGS.replace('n_layer=2', 'n_layer=3')}: missing blocks.2.",
    ),
    (
        "mis-shaped",
        ["RUN", "--to", "gpt2-hf", "DIR", "--model-args", ARGS.replace("n_embd=32", "n_embd=48")],
        "mis-shaped blocks.0.attn.c_attn.bias [96] (want [144])",
    ),
    (
        "no qkv bias",
        ["RUN", "--to", "gpt2-hf", "DIR", "--model", "gpt", "--model-args", ARGS],
        "--model gpt --model-args " + ARGS + " has no query/key/value bias",
    ),
    ("not a GPT", ["RUN", "--to", "gpt2-hf", "DIR", "--model", "branchy"], "not the built-in GPT"),
    (
        "heads",
        ["RUN", "--to", "gpt2-hf", "DIR", "--model-args", "n_embd=30,n_head=4"],
        "n_embd 30 is not a multiple of n_head 4",
    ),
    (
        "untied file",
        ["RUN", "--to", "gpt2-hf", "DIR", "--model-args", ARGS + ",tie_weights=true"],
        "lm_head.weight differs from wte.weight",
    ),
    ("bad model args", ["RUN", "--to", "gpt2-hf", "DIR", "--model-args", "n_layer"], "'n_layer' is not KEY=VALUE"),
    ("unknown model arg", ["RUN", "--to", "gpt2-hf", "DIR", "--model-args", "colour=red"], "failed to build"),
    ("not empty", ["RUN", "--to", "gpt2-hf", "FULL"], "is not empty (--force writes"),
    ("a file", ["RUN", "--to", "gpt2-hf", "RUN"], "exists and is not a directory"),
    ("format", ["RUN", "--to", "onnx", "DIR"], "argument --to: invalid choice: 'onnx'"),
    ("no format", ["RUN", "DIR"], "the following arguments are required: --to"),
]


@pytest.mark.parametrize("args, needle", [(a, n) for _, a, n in BAD], ids=[w for w, _, _ in BAD])
def test_a_bad_export_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, run_file: Path, args: list[str], needle: str
) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"\x07" * 64)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    names = {"RUN": run_file, "NOPE": tmp_path / "nope.safetensors", "JUNK": tmp_path / "junk.safetensors"}
    names |= {"DIR": tmp_path / "out", "FULL": tmp_path / "full"}
    r = run_cli("export", *(str(names.get(a, a)) for a in args))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


def test_a_usage_error_answers_before_torch_is_imported() -> None:
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-X", "importtime", "-m", "fusionllm", "export", "a.safetensors", "--to", "onnx", "out"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 2, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert "fusionllm" in imported and imported.isdisjoint({"torch", "numpy", "transformers"}), sorted(imported)
