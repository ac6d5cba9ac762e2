"""The command line: training equivalence through files, inspect, and one-line errors."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from fusionllm.local import compare_checkpoints


@pytest.mark.parametrize(
    "model_flags",
    [
        ["--model", "gpt", "--model-args", "n_layer=2,n_embd=64,n_head=4"],
        ["--model", "zoo.branchy:branchy", "--data", "zoo.branchy:branchy_data"],
    ],
    ids=["gpt", "branchy"],
)
def test_train_three_stages_equals_reference(cli, tmp_path: Path, model_flags: list[str]) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    common = ["--steps", "10", "--seed", "0", *model_flags]
    r1 = cli("train", "--stages", "3", *common, "--save", str(a))
    assert r1.returncode == 0, r1.stderr
    r2 = cli("train", "--reference", *common, "--save", str(b))
    assert r2.returncode == 0, r2.stderr
    assert compare_checkpoints(a, b) <= 1e-5
    r3 = cli("compare", str(a), str(b))
    assert r3.returncode == 0 and "equal within" in r3.stdout
    # a different seed gives different weights: the comparison can fail
    c = tmp_path / "c.safetensors"
    assert cli("train", "--reference", *common[:2], "--seed", "1", *model_flags, "--save", str(c)).returncode == 0
    assert compare_checkpoints(a, c) > 1e-3
    assert cli("compare", str(a), str(c)).returncode == 1


def test_inspect_json_and_text(cli) -> None:
    r = cli("inspect", "--model", "branchy", "--stages", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["max_relative_error"] <= 1e-5
    assert len(out["cut"]) == 2 and len(out["boundary_bytes"]) == 2 and all(b > 0 for b in out["boundary_bytes"])
    assert out["num_ops"] == len(out["ops"]) and out["total_flops"] > 0
    r = cli("inspect", "--model", "tests/models.py:tied", "--data", "tests/models.py:tied_data", "--stages", "2")
    assert r.returncode == 0, r.stderr
    assert "stage 1" in r.stdout and "largest relative error" in r.stdout and "OK" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--reference", "--model", "no_such_module:build"], "cannot import 'no_such_module'"),
        (["train", "--reference", "--model", "justaname"], "is not MODULE:FUNC"),
        (["train", "--reference", "--model", "zoo.gpt:nothing"], "has no callable 'nothing'"),
        (["train", "--reference", "--model", "missing/file.py:f"], "no file missing/file.py"),
        (["train", "--reference", "--model", "tests/models.py:not_a_module"], "not a torch.nn.Module"),
        (["inspect", "--model", "branchy", "--stages", "5000"], "larger than the model's"),
        (["train", "--stages", "0"], "must be at least 1"),
        (["train", "--steps", "x", "--reference"], "is not an integer"),
        (["train"], "one of the arguments --reference --stages is required"),
        (["train", "--reference", "--save", "out.pt"], "must end in .safetensors"),
        (["inspect", "--model", "branchy", "--cut", "a,b"], "is not a comma-separated list"),
        (
            ["inspect", "--model", "tests/models.py:tied", "--data", "tests/models.py:tied_data", "--cut", "6"],
            "tied weights",
        ),
        (["train", "--reference", "--model-args", "block_size=32"], "fails on the first micro-batch of data 'stdlib'"),
        (["demo", "--model-args", "block_size=32"], "model 'gpt' fails on the first micro-batch"),
        (["join", "--initial-peers", "/ip4/1.2.3.4/tcp/1", "--coordinator-key", "zz"], "is not an Ed25519 public key"),
        (["frobnicate"], "invalid choice"),
        (["demo", "--compression", "zip"], "'zip' is not one of none, fp16, bf16, int8, int4, adatopk, auto"),
        (["demo", "--topk-fraction", "1.5"], "1.5 is not in (0, 1]"),
        (["demo", "--rank", "0"], "0 is not in [1, 65536]"),
        (["demo", "--rank", "2.5"], "'2.5' is not a whole number"),
        (["demo", "--compression", "auto", "--rank", "8"], "--rank pins the low rank of --compression auto-lowrank"),
        (["demo", "--topk-fraction", "0.2"], "--topk-fraction pins the kept fraction of --compression adatopk"),
        (["demo", "--link-mbps", "10,fast"], "is not a comma-separated list of Mbit/s"),
        (["demo", "--link-mbps", "10,-1"], "rates must be finite and at least 0"),
        (["demo", "--peers", "3", "--link-mbps", "10"], "--link-mbps gives 1 rates for 2 stage boundaries"),
        # issue 30's list: tracebacks and silent accepts before
        (["compare", "README.md", "README.md"], "README.md: not a readable safetensors file"),
        (["compare", "no/such.safetensors", "README.md"], "no/such.safetensors: no such file"),
        (["compare", "README.md", "README.md", "--tol", "nan"], "--tol: nan is not a finite tolerance"),
        (["compare", "README.md", "README.md", "--tol", "-1"], "--tol: -1 is not a finite tolerance"),
        (["join", "--initial-peers", "/ip4/1.2.3.4/tcp/1", "--device", "bogus"], "--device 'bogus': not a device"),
        (["join", "--initial-peers", "/ip4/1.2.3.4/tcp/1", "--device", "meta"], "a peer trains on cpu, cuda or mps"),
        (["train", "--reference", "--model-args", "n_layer=-1"], "n_layer must be a whole number of at least 1"),
        (["train", "--reference", "--model-args", "n_head=3"], "n_embd 128 is not a multiple of n_head 3"),
        (["ban", "12D3KooWAbc", "--run-dir", "docs"], "--run-dir docs: not a run directory (no run.sqlite)"),
        # flags a command does not use are refused, not ignored
        (["plan", "--topology", "testbed1", "--lr", "0.1"], "unrecognized arguments: --lr 0.1"),
        (["plan", "--topology", "testbed1", "--steps", "5"], "unrecognized arguments: --steps 5"),
        (["sim", "--topology", "testbed1", "--save", "a.safetensors"], "unrecognized arguments: --save"),
        (["sim", "--topology", "testbed1", "--init", "a.safetensors"], "unrecognized arguments: --init"),
        (["sim", "--topology", "testbed1", "--eval-every", "5"], "unrecognized arguments: --eval-every 5"),
        (["inspect", "--save", "a.safetensors"], "unrecognized arguments: --save"),
        (["demo", "--run", "mine"], "unrecognized arguments: --run mine"),  # once taken as --run-dir
        (["demo", "--peer", "3"], "unrecognized arguments: --peer 3"),
        (["coordinator", "--peer-wait", "-1"], "-1.0 is not a positive number of seconds"),
        # --plot is checked before simulating
        (["sim", "--topology", "testbed1", "--plot", "no/such/dir/out.png"], "no folder no/such/dir"),
        (["sim", "--topology", "testbed1", "--plot", "out.pdf"], "out.pdf: the plot is a .png file"),
    ],
)
def test_usage_errors_are_one_line_exit_2(cli, args: list[str], needle: str) -> None:
    r = cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr


def test_untraceable_model_is_one_line(cli) -> None:
    r = cli("inspect", "--model", "tests/models.py:untraceable", "--data", "tests/models.py:tied_data")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch.fx cannot trace" in lines[0] and "if h.sum() > 0" in lines[0]


#: what parsing a command line must not import: they take seconds, and a usage error or --help needs none
HEAVY = ("torch", "hivemind", "numpy", "scipy")


def test_parsing_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    argvs = [
        ["demo", "--steps", "3", "--spot-check", "0.1", "--stages-as", "code", "--betas", "0.9,0.95"],
        ["join", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--throttle", "0.5", "--throttle-call-ms", "0.4"],
        ["plan", "--topology", "testbed1", "--model", "gpt2", "--precision", "fp16", "--scheduler", "dtfm"],
        ["sim", "--topology", "testbed1", "--schedulers", "opfence,even", "--policy", "none"],
    ]
    code = (
        "import json, sys\nfrom fusionllm.cli import build_parser\n"
        f"for argv in {argvs!r}:\n    build_parser().parse_args(argv)\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["demo", "--steps", "0"], 2, "argument --steps: 0 must be at least 1"),
        (["demo", "--bogus"], 2, "unrecognized arguments: --bogus (see fusionllm demo --help)"),
        (["join", "--help"], 0, ""),
        (
            ["plan", "--topology", "testbed1", "--steps", "3"],
            2,
            "unrecognized arguments: --steps 3 (see fusionllm plan --help)",
        ),
        (["sim", "--topology", "testbed1", "--plot", "/no/such/out.png"], 2, "argument --plot: /no/such/out.png: no"),
        (["sim", "-v", "--help"], 0, ""),
        (
            ["join", "--throttle-call-ms", "1e9"],
            2,
            "argument --throttle-call-ms: 1000000000.0 is not a number of milliseconds from 0 to 1000",
        ),
    ],
    ids=["bad-value", "bad-flag", "help", "plan-steps", "plot-folder", "verbose-help", "call-ms"],
)
def test_usage_errors_and_help_import_nothing_heavy(args: list[str], code: int, needle: str) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-X", "importtime", "-m", "fusionllm", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == code, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert "fusionllm" in imported and imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))
    said = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == (1 if code else 0) and all(line.startswith(f"fusionllm: error: {needle}") for line in said)


def test_every_command_has_its_handler() -> None:
    import argparse
    import importlib

    from fusionllm.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(COMMANDS) == set(sub.choices)
    assert all(callable(getattr(importlib.import_module(m), f"cmd_{c}", None)) for c, m in COMMANDS.items())


def test_plan_and_sim_name_every_preset_in_their_help(cli) -> None:
    from sim.presets import PRESETS

    for command in ("plan", "sim"):
        r = cli(command, "--help")
        assert r.returncode == 0 and all(name in " ".join(r.stdout.split()) for name in PRESETS), r.stdout


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its name ('data prepare' for the nested one)."""
    from fusionllm.cli import build_parser

    out, todo = {}, [("", build_parser())]
    while todo:
        name, p = todo.pop()
        out[name] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend((f"{name} {n}".strip(), child) for n, child in a.choices.items())
    return out


def test_every_flag_has_a_description_and_shows_its_default() -> None:
    missing, no_default = [], []
    for name, p in _parsers().items():
        formatter = p._get_formatter()
        either = {a for g in p._mutually_exclusive_groups if g.required for a in g._group_actions}
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = f"{name} {a.option_strings[-1] if a.option_strings else a.dest}"
            if not a.help:
                missing.append(flag)
            elif a.option_strings and a.nargs != 0 and not a.required and a not in either:
                if "default" not in formatter._get_help_string(a) % {"default": a.default}:
                    no_default.append(flag)
    assert missing == [] and no_default == []
    help_text = _parsers()["train"].format_help()
    assert "optimizer steps (default: 1200)" in " ".join(help_text.split())


def test_each_command_takes_only_the_flags_it_uses() -> None:
    parsers = _parsers()
    flags = {name: {s for a in p._actions for s in a.option_strings} for name, p in parsers.items()}
    recipe = {"--steps", "--lr", "--save", "--init", "--eval-every", "--warmup", "--betas"}
    assert flags["plan"] & recipe == set() and flags["sim"] & recipe == set()
    assert flags["inspect"] & recipe == set() and {"--micro-batches", "--precision"} <= flags["inspect"]
    assert recipe <= flags["train"] and recipe <= flags["demo"] and recipe <= flags["coordinator"]
    assert "--run" not in flags["demo"], "the demo names its own run"


def test_one_default_for_steps() -> None:
    from fusionllm.cli import build_parser
    from fusionllm.usage import DEFAULT_STEPS

    parser = build_parser()
    argvs = [["demo"], ["coordinator"], ["train", "--reference"]]
    assert {parser.parse_args(argv).steps for argv in argvs} == {DEFAULT_STEPS}


@pytest.mark.parametrize(
    "argv, verbose",
    [
        (["-v", "plan", "--topology", "testbed1"], True),
        (["plan", "--topology", "testbed1", "-v"], True),
        (["plan", "-v", "--topology", "testbed1"], True),
        (["data", "prepare", "x.txt", "-o", "out", "--verbose"], True),
        (["plan", "--topology", "testbed1"], False),
    ],
)
def test_verbose_anywhere_on_the_line(argv: list[str], verbose: bool) -> None:
    from fusionllm.cli import build_parser

    assert build_parser().parse_args(argv).verbose is verbose


def test_sim_plot_names_model_and_topology_marks_churn_and_keeps_equal_lines_apart() -> None:
    from sim.engine import Churn, SimResult
    from sim.plot import draw

    same = [1.0, 1.0, 2.0, 1.0]
    results = {n: SimResult(n, list(same), 1.0, 0.5) for n in ("opfence", "bw-blind", "even")}
    churn = [Churn(1, "leave", "a"), Churn(2, "join", "b"), Churn(2, "slow", "c", 0.5)]
    fig = draw(results, "gpt2 (n_layer=2) on testbed1 (16 peers)", churn)
    ax = fig.axes[0]
    assert "gpt2" in ax.get_title() and "testbed1" in ax.get_title()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_label() not in results) == [1, 2, 2]
    drawn = [lines[n] for n in results]
    assert len({str(line.get_linestyle()) for line in drawn}) == 3 and len({line.get_marker() for line in drawn}) == 3
    assert drawn[0].get_linewidth() > drawn[1].get_linewidth() > drawn[2].get_linewidth()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["opfence", "bw-blind", "even", "churn: leave", "churn: join", "churn: slow"]


def _small_topology(path: Path) -> Path:
    """Two clusters of three peers behind a 50 Mbit/s link, and one peer too small for anything."""
    peer = {"tflops": 20, "memory_gb": 24}
    peers = [{"id": f"{c}{i}", "cluster": c, **peer} for c in "AB" for i in range(3)]
    peers.append({"id": "tiny", "cluster": "A", "tflops": 20, "memory_gb": 0.000001})
    fast, slow = {"mbps": 10000, "latency_ms": 0.1}, {"mbps": 50, "latency_ms": 40}
    path.write_text(json.dumps({"peers": peers, "clusters": {"A": {"A": fast, "B": slow}, "B": {"B": fast}}}))
    return path


def test_plan_and_sim_name_the_model_and_the_peers_left_out(cli, tmp_path: Path) -> None:
    topo = str(_small_topology(tmp_path / "t.json"))
    model = ["--model", "gpt", "--model-args", "n_layer=2,n_embd=64,n_head=4"]
    r = cli("plan", "--topology", topo, *model)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gpt (n_layer=2,n_embd=64,n_head=4): ") and "the model's own data" in r.stdout
    assert "left out 1 peer [tiny]: too little memory" in r.stdout, r.stdout
    r = cli("plan", "--topology", topo, *model, "--json")
    out = json.loads(r.stdout)
    assert out["workload"]["model"] == "gpt" and out["topology"] == "t"
    assert any(ids == ["tiny"] and why.startswith("too little memory") for why, ids in out["left_out"].items())
    sim = ["sim", "--topology", topo, *model, "--schedulers", "opfence,even", "--iterations", "3"]
    r = cli(*sim)
    assert r.returncode == 0, r.stderr
    assert "gpt (n_layer=2" in r.stdout and "left out 1 peer [tiny]" in r.stdout
    assert "opfence" in r.stderr and "6/6" in r.stderr, "progress on stderr"
    r = cli(*sim, "--json")
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout)["workload"]["model"] == "gpt"


def test_the_command_freezes_its_objects_before_the_interpreter_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The final collection of a demo's objects took 5-7 s after its last line."""
    import gc

    from fusionllm import cli

    monkeypatch.setattr(cli, "main", lambda: 3)
    try:
        with pytest.raises(SystemExit) as exited:
            cli.run()
        assert exited.value.code == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_rebalancing_is_on_unless_turned_off() -> None:
    """Since plans are priced on the share of a machine's cores they leave its peers,
    rebalancing runs by default (``--rebalance-every 0`` turns it off)."""
    from coordinator.config import CoordinatorConfig
    from coordinator.defaults import DEFAULT_REBALANCE_EVERY
    from fusionllm.cli import build_parser
    from fusionllm.swarm_cmds import _recovery_options
    from protocol.model.job import JobSpec

    def every(*flags: str) -> int:
        options = _recovery_options(build_parser().parse_args(["demo", *flags]))
        return CoordinatorConfig(JobSpec(), **options).rebalance_every

    assert DEFAULT_REBALANCE_EVERY > 0 and every() == DEFAULT_REBALANCE_EVERY
    assert every("--rebalance-every", "0") == 0 and every("--rebalance-every", "7") == 7


def test_every_command_runs_with_the_short_gil_switch_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's event loop waits for the GIL at most ``SWITCH_INTERVAL_S`` behind its
    compute thread (Python's 5 ms held frames up); ``FUSIONLLM_SWITCH_S`` overrides it
    with a sane number only."""
    from fusionllm import cli

    before = sys.getswitchinterval()
    try:
        for given, expected in (("", cli.SWITCH_INTERVAL_S), ("0.002", 0.002), ("x", cli.SWITCH_INTERVAL_S),
                                ("-1", cli.SWITCH_INTERVAL_S), ("50", cli.SWITCH_INTERVAL_S)):  # fmt: skip
            monkeypatch.setenv("FUSIONLLM_SWITCH_S", given)
            sys.setswitchinterval(0.005)
            with pytest.raises(SystemExit):
                cli.main(["demo", "--help"])
            assert sys.getswitchinterval() == pytest.approx(expected), given
    finally:
        sys.setswitchinterval(before)
