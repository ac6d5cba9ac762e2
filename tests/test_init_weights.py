"""Starting weights (issue 17, item 1): ``--init`` loads the model's own state dict or
GPT-2's published layout strictly, and refuses every bad file with one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from coordinator.weights import InitError, read_init
from fusionllm.local import job_model, save_state
from protocol.model.job import JobSpec
from tests.conftest import run_cli

LAYERS, EMBD, HEADS, CTX, VOCAB = 2, 32, 4, 16, 256
GPT2_ARGS = f"n_layer={LAYERS},n_embd={EMBD},n_head={HEADS},block_size={CTX}"


def _gpt2_file(path: Path, prefix: str = "", head: bool = False) -> dict[str, torch.Tensor]:
    """Random weights named and laid out as GPT-2's release: Conv1D weights are
    (in, out), the causal masks are buffers, the LM head is the token embedding."""
    g = torch.Generator().manual_seed(3)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    w = {"wte.weight": r(VOCAB, EMBD), "wpe.weight": r(CTX, EMBD), "ln_f.weight": 1 + r(EMBD), "ln_f.bias": r(EMBD)}
    for i in range(LAYERS):
        h = f"h.{i}."
        w |= {h + "ln_1.weight": 1 + r(EMBD), h + "ln_1.bias": r(EMBD), h + "ln_2.weight": 1 + r(EMBD)}
        w |= {
            h + "ln_2.bias": r(EMBD),
            h + "attn.c_attn.weight": r(EMBD, 3 * EMBD),
            h + "attn.c_attn.bias": r(3 * EMBD),
        }
        w |= {h + "attn.c_proj.weight": r(EMBD, EMBD), h + "attn.c_proj.bias": r(EMBD)}
        w |= {h + "mlp.c_fc.weight": r(EMBD, 4 * EMBD), h + "mlp.c_fc.bias": r(4 * EMBD)}
        w |= {h + "mlp.c_proj.weight": r(4 * EMBD, EMBD), h + "mlp.c_proj.bias": r(EMBD)}
        w[h + "attn.bias"] = torch.tril(torch.ones(CTX, CTX)).view(1, 1, CTX, CTX)
    if head:
        w["lm_head.weight"] = w["wte.weight"].clone()
    save_file({prefix + k: v.contiguous() for k, v in w.items()}, str(path))
    return w


def _gpt2_loss(w: dict[str, torch.Tensor], idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward pass written from its published layout, independently of our model."""
    B, T = idx.shape
    x = w["wte.weight"][idx] + w["wpe.weight"][:T]
    for i in range(LAYERS):
        h = f"h.{i}."
        a = F.layer_norm(x, (EMBD,), w[h + "ln_1.weight"], w[h + "ln_1.bias"])
        q, k, v = (a @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, EMBD // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(EMBD // HEADS)
        att = att.masked_fill(w[h + "attn.bias"][:, :, :T, :T] == 0, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, EMBD)
        x = x + y @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        m = F.layer_norm(x, (EMBD,), w[h + "ln_2.weight"], w[h + "ln_2.bias"])
        m = F.gelu(m @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    logits = F.layer_norm(x, (EMBD,), w["ln_f.weight"], w["ln_f.bias"]) @ w["wte.weight"].T
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("prefix, head", [("", False), ("transformer.", True)])
def test_gpt2_layout_loads_onto_the_builtin_gpt2(tmp_path: Path, prefix: str, head: bool) -> None:
    path = tmp_path / "gpt2.safetensors"
    w = _gpt2_file(path, prefix, head)
    job = JobSpec(model="gpt2", model_args=GPT2_ARGS, data_args=f"batch_size=4,ctx={CTX}", init=str(path))
    model = job_model(job)
    assert torch.equal(model.blocks[1].fc.weight, w["h.1.mlp.c_fc.weight"].T), "Conv1D weights are transposed"
    idx, targets = next(iter(job.batches()))
    with torch.no_grad():
        assert float(model(idx, targets)) == pytest.approx(float(_gpt2_loss(w, idx, targets)), rel=1e-5)


def test_our_own_state_dict_round_trips(tmp_path: Path) -> None:
    job = JobSpec(model_args="n_layer=1,n_embd=16,n_head=2", seed=4)
    path = tmp_path / "own.safetensors"
    save_state(job.build_model(), path)
    loaded = job_model(JobSpec(model_args="n_layer=1,n_embd=16,n_head=2", seed=9, init=str(path)))
    want = job.build_model().state_dict()
    assert all(torch.equal(t, want[k]) for k, t in loaded.state_dict().items())


def _broken(tmp_path: Path, kind: str) -> Path:
    model = JobSpec(model_args="n_layer=1,n_embd=16,n_head=2").build_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = tmp_path / f"{kind}.safetensors"
    if kind == "missing":
        del state["ln_f.weight"]
    elif kind == "unexpected":
        state["blocks.7.fc.weight"] = torch.zeros(2, 2)
    elif kind == "mis-shaped":
        state["wte.weight"] = torch.zeros(255, 16)
    elif kind == "non-finite":
        state["lm_head.weight"][0, 0] = float("nan")
    elif kind == "mis-typed":
        state["wpe.weight"] = torch.zeros(128, 16, dtype=torch.int32)
    elif kind == "not safetensors":
        path.write_bytes(b"\xff" * 64)
        return path
    save_file(state, str(path))
    return path


BAD = {
    "missing": "missing ln_f.weight",
    "unexpected": "unexpected blocks.7.fc.weight",
    "mis-shaped": "mis-shaped wte.weight [255, 16] (want [256, 16])",
    "non-finite": "non-finite lm_head.weight",
    "mis-typed": "mis-typed wpe.weight torch.int32",
    "not safetensors": "not a readable safetensors file",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_init_file_is_refused_with_its_line(tmp_path: Path, kind: str) -> None:
    path = _broken(tmp_path, kind)
    model = JobSpec(model_args="n_layer=1,n_embd=16,n_head=2").build_model()
    with pytest.raises(InitError) as err:
        read_init(path, model)
    assert BAD[kind] in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["train", "demo"])
def test_the_cli_refuses_a_bad_init_before_anything_starts(tmp_path: Path, command: str) -> None:
    path = _broken(tmp_path, "mis-shaped")
    extra = ["--reference"] if command == "train" else ["--peers", "2"]
    r = run_cli(command, *extra, "--model-args", "n_layer=1,n_embd=16,n_head=2", "--init", str(path), timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "mis-shaped wte.weight" in last and "Traceback" not in r.stderr, r.stderr
