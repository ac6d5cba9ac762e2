"""Your own corpus: ``fusionllm data prepare`` writes token shards, ``--data tokens:DIR``
trains on them (seeded windows, any step at once, the validation split), and every
bad input is one line with exit code 2."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fusionllm.local import compare_checkpoints
from protocol.model.job import JobSpec, SpecError
from tests.conftest import run_cli
from zoo import tokens
from zoo.shards import ShardMeta

#: the model of the training runs: tiny, with the trained tokenizer's vocabulary added per test
TINY = "n_layer=2,n_embd=32,n_head=2,block_size=32"
DATA_ARGS = "batch_size=8,ctx=32"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _write_corpus(root: Path) -> dict[str, str]:
    """Twenty text files and a .jsonl of ten documents; each document names itself
    (``doc-N``) once, so where it went can be told. Its texts by marker."""
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(30):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(60 + 5 * i))
        texts[f"doc-{i:02d}"] = f"doc-{i:02d} says: {words}.\n"
    for i in range(20):
        (root / f"part{i:02d}.txt").write_text(texts[f"doc-{i:02d}"])
    with (root / "more.jsonl").open("w") as f:
        for i in range(20, 30):
            f.write(json.dumps({"text": texts[f"doc-{i:02d}"]}) + "\n\n")  # blank lines are no documents
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, _write_corpus(root / "text")


@pytest.fixture(scope="module")
def bpe(corpus: tuple[Path, dict[str, str]]) -> Path:
    """Shards of the corpus with a byte-level BPE trained on it."""
    root, _ = corpus
    out = root / "bpe"
    flags = ["--train-tokenizer", "300", "--val-fraction", "0.1"]
    r = run_cli("data", "prepare", str(root / "text"), "-o", str(out), *flags)
    assert r.returncode == 0, r.stderr
    assert f"--data tokens:{out}" in r.stdout
    return out


def _ids(directory: Path, split: str) -> np.ndarray:
    meta = ShardMeta.read(directory)
    return np.fromfile(directory / meta.splits[split].file, dtype=meta.dtype)


def test_prepare_trains_a_tokenizer_and_writes_shards(bpe: Path, corpus: tuple[Path, dict[str, str]]) -> None:
    import tokenizers

    _, texts = corpus
    meta = ShardMeta.read(bpe)
    assert 256 < meta.vocab_size <= 300 and meta.dtype == "uint16" and meta.eot == 0
    assert meta.tokenizer["kind"] == "tokenizers" and (bpe / meta.tokenizer["file"]).is_file()
    assert {s: v.documents for s, v in meta.splits.items()} == {"train": 27, "val": 3}
    tok = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json"))
    assert tok.get_vocab_size() == meta.vocab_size
    for split, info in meta.splits.items():
        ids = _ids(bpe, split)
        assert ids.size == info.tokens and (bpe / info.file).stat().st_size == 2 * info.tokens
        assert int((ids == meta.eot).sum()) == info.documents  # one separator after each document
        assert int(ids.max()) < meta.vocab_size
        # the ids decode back to the documents, whole and in order
        docs = [tok.decode(d.tolist()) for d in np.split(ids, np.flatnonzero(ids == meta.eot) + 1) if d.size > 1]
        assert all(d.rstrip("\x00") in texts.values() for d in docs), docs[:1]


def test_a_given_tokenizer_json_makes_the_same_shards(tmp_path: Path, bpe: Path, corpus: tuple[Path, Any]) -> None:
    """The copy in DIR is the tokenizer: preparing again with it gives the same ids."""
    out = tmp_path / "again"
    # a flag beside its value, as on a command line (fmt: skip below)
    r = run_cli("data", "prepare", str(corpus[0] / "text"), "-o", str(out), "--tokenizer", str(bpe / "tokenizer.json"),
                "--val-fraction", "0.1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert all((out / f).read_bytes() == (bpe / f).read_bytes() for f in ("train.bin", "val.bin"))
    assert ShardMeta.read(out).tokenizer["name"] == "tokenizer.json"


def test_validation_holds_out_whole_documents(tmp_path: Path, corpus: tuple[Path, dict[str, str]]) -> None:
    root, texts = corpus
    out = tmp_path / "bytes"
    r = run_cli("data", "prepare", str(root / "text"), "-o", str(out), "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    meta = ShardMeta.read(out)
    assert meta.vocab_size == 256 and meta.dtype == "uint8" and meta.eot is None
    train, val = (_ids(out, s).tobytes().decode() for s in ("train", "val"))
    held = {m for m in texts if m in val}
    assert len(held) == 6 and all(texts[m] in val and m not in train for m in held)
    assert all(texts[m] in train for m in set(texts) - held)
    assert len(train) + len(val) == sum(len(t) for t in texts.values())  # bytes: the text itself
    assert meta.source_bytes >= len(train) + len(val)


def test_loader_is_seeded_and_starts_at_any_step(bpe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = list(itertools.islice(tokens.token_batches(0, 4, 16, path=str(bpe)), 6))
    again = list(itertools.islice(tokens.token_batches(0, 4, 16, path=str(bpe)), 6))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(stream, again))
    idx, targets = stream[0]
    assert idx.shape == (4, 16) and idx.dtype == torch.int64 and torch.equal(idx[:, 1:], targets[:, :-1])
    other = next(tokens.token_batches(1, 4, 16, path=str(bpe)))
    assert not torch.equal(other[0], idx)
    # step N at once: batch 4 of a stream started at 4 is the one the whole stream yields there
    reads: list[int] = []
    real = tokens.Shard.windows
    monkeypatch.setattr(tokens.Shard, "windows", lambda self, s, n: reads.append(1) or real(self, s, n))
    jumped = next(tokens.token_batches(0, 4, 16, path=str(bpe), start=4))
    assert torch.equal(jumped[0], stream[4][0]) and len(reads) == 1
    job = JobSpec(data=f"tokens:{bpe}", data_args="batch_size=4,ctx=16")
    far = next(job.batches(start=1_000_000))
    assert torch.equal(far[0], next(tokens.token_batches(0, 4, 16, path=str(bpe), start=1_000_000))[0])
    assert len(reads) == 3  # one read each: no million batches replayed
    # the validation split reads val.bin: its windows are runs of it
    val_ids = _ids(bpe, "val").astype(np.int64)
    row = next(job.batches("val"))[0][0].numpy()
    assert any(np.array_equal(val_ids[s : s + row.size], row) for s in range(val_ids.size - row.size + 1))


def test_stdlib_data_reaches_step_n_as_before() -> None:
    """A factory without ``start`` is read past the first batches, as the coordinator always did."""
    job = JobSpec(data="branchy")
    jumped = next(job.batches(start=3))
    replayed = next(itertools.islice(job.batches(), 3, None))
    assert all(torch.equal(a, b) for a, b in zip(jumped, replayed))


def test_a_model_of_another_vocabulary_is_refused(bpe: Path) -> None:
    vocab = ShardMeta.read(bpe).vocab_size
    job = JobSpec(data=f"tokens:{bpe}", model_args=TINY, data_args=DATA_ARGS)
    with pytest.raises(SpecError, match=f"pass --model-args vocab_size={vocab}"):
        job.checked_model()
    JobSpec(data=f"tokens:{bpe}", model_args=f"{TINY},vocab_size={vocab}", data_args=DATA_ARGS).checked_model()


def _one_line_exit_2(args: list[str], needle: str) -> None:
    r = run_cli(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and needle in lines[0], lines[0]


# the cases' ids wrapped to a few lines, not one to a line (fmt: skip below)
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["MISSING"], "no such file or folder"),
        (["EMPTY"], "the corpus is empty"),
        (["ONE", "--val-fraction", "0.5"], "leaves none for training"),
        (["TEXT", "--val-fraction", "1.5"], "is not a fraction in [0, 1)"),
        (["TEXT", "--val-fraction", "x"], "'x' is not a number"),
        (["TEXT", "--tokenizer", "nosuch"], "not bytes, gpt2 or a tokenizer.json"),
        (["TEXT", "--tokenizer", "gpt2"], "GPT-2's BPE files are not in tiktoken's cache"),
        (["TEXT", "--train-tokenizer", "100"], "the vocabulary must be 257 to"),
        (["TEXT", "--train-tokenizer", "300", "--tokenizer", "gpt2"], "not both"),
        (["BADJSON"], "bad.jsonl:2: not JSON"),
    ],
    ids=["missing", "empty", "nothing-to-train", "fraction-high", "fraction-text", "unknown-tokenizer",
         "tiktoken-missing", "tiny-vocab", "both", "bad-jsonl"],
)  # fmt: skip
def test_bad_inputs_are_one_line_exit_2(
    tmp_path: Path, corpus: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch, extra: list[str], needle: str
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "nothing.txt").write_text("")
    (tmp_path / "one.txt").write_text("a single document\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))  # empty: GPT-2's files are not here
    # a small table kept on two lines (fmt: skip below)
    where = {"MISSING": tmp_path / "missing.txt", "EMPTY": tmp_path / "empty", "ONE": tmp_path / "one.txt",
             "TEXT": corpus[0] / "text", "BADJSON": tmp_path / "bad.jsonl"}  # fmt: skip
    args = [str(where.get(a, a)) for a in extra]
    _one_line_exit_2(["data", "prepare", *args, "-o", str(tmp_path / "out")], needle)


def test_training_on_bad_shards_is_one_line_exit_2(tmp_path: Path, bpe: Path) -> None:
    flags = ["train", "--reference", "--steps", "1", "--data-args", DATA_ARGS]
    _one_line_exit_2([*flags, "--model-args", TINY, "--data", f"tokens:{bpe}"], "vocab_size=")
    _one_line_exit_2([*flags, "--data", f"tokens:{tmp_path}"], "no token shards there")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bpe.iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[: 100 if f.name == "train.bin" else None])
    vocab = ShardMeta.read(bpe).vocab_size
    fitting = ["--model-args", f"{TINY},vocab_size={vocab}"]
    _one_line_exit_2([*flags, *fitting, "--data", f"tokens:{broken}"], "as meta says")


def _val_losses(out: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in re.findall(r"^validation loss after step (\d+): ([\d.]+)$", out, re.M)]


def test_three_peers_on_the_shards_equal_the_reference(tmp_path: Path, bpe: Path) -> None:
    vocab = ShardMeta.read(bpe).vocab_size
    common = ["--steps", "4", "--seed", "0", "--model-args", f"{TINY},vocab_size={vocab}", "--data-args", DATA_ARGS]
    common += ["--data", f"tokens:{bpe}", "--eval-every", "2"]
    ref = tmp_path / "ref.safetensors"
    r = run_cli("train", "--reference", *common, "--threads", "1", "--save", str(ref))
    assert r.returncode == 0, r.stderr
    want = _val_losses(r.stdout)
    assert [s for s, _ in want] == [2, 4]
    swarm = tmp_path / "swarm.safetensors"
    s = run_cli("demo", "--peers", "3", *common, "--save", str(swarm), timeout=240)
    assert s.returncode == 0, s.stdout + s.stderr
    assert compare_checkpoints(swarm, ref) <= 1e-5
    got = _val_losses(s.stdout)
    assert [n for n, _ in got] == [2, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)


def test_volunteers_never_read_the_data() -> None:
    """Only the coordinator reads batches: peers get micro-batches in messages, so the
    shards stay on the coordinator's machine (nothing under peer/ asks a job for data)."""
    root = Path(__file__).resolve().parent.parent / "peer"
    readers = ("batches(", "first_micro_batch", "eval_micro_batches", "zoo.tokens", "zoo.text", "_data_factory")
    found = [f"{p.name}: {r}" for p in sorted(root.rglob("*.py")) for r in readers if r in p.read_text()]
    assert found == []


def test_a_rollback_and_a_resume_read_the_same_windows(tmp_path: Path, bpe: Path) -> None:
    """On token shards, the coordinator killed mid-run and resumed from its run directory,
    then a peer killed (its stage's standby takes over from the last checkpoint: a
    rollback): the run draws each step's windows by the step, so it ends on the weights
    of the uninterrupted run, ``train --reference``."""
    import signal

    from tests.swarmproc import Swarm, wait_for, wait_gone

    steps, vocab = 120, ShardMeta.read(bpe).vocab_size
    model = ["--model-args", f"{TINY},vocab_size={vocab}", "--data", f"tokens:{bpe}", "--data-args", DATA_ARGS]
    common = ["--steps", str(steps), "--seed", "0", *model]
    ref = tmp_path / "ref.safetensors"
    assert run_cli("train", "--reference", *common, "--threads", "1", "--save", str(ref)).returncode == 0
    out = tmp_path / "swarm.safetensors"
    plan = ["--min-peers", "3", "--stages", "2", "--standby", "1", "--checkpoint-every", "10", "--spot-check", "0"]
    files = ["--save", str(out), "--run-dir", str(tmp_path / "run"), "--step-timeout", "60"]
    swarm = Swarm(tmp_path, [*common, *plan, *files], peers=3)
    try:
        wait_for(swarm.url, lambda st: st["training"]["step"] >= 15, poll=0.05)
        swarm.coord.signal(signal.SIGKILL)
        for p in swarm.peers.values():  # as test_elastic: a coordinator back before they noticed is not re-met
            p.wait_line(r"lost the coordinator .* waiting up to \d+ s", 30)
        assert wait_gone(swarm.procs[0].pids) == set()
        coord = swarm.start_coordinator("--resume", str(tmp_path / "run"))
        resumed = int(coord.wait_line(r"resuming run .* from the checkpoint of step ([1-9]\d*) ", 60).group(1))
        url = coord.wait_line(r"^status page: (\S+)").group(1)

        def training_again(st: dict[str, Any]) -> bool:  # past the restored step, stage 1 served
            return st["training"]["step"] > resumed + 2 and 1 in {s for s, _ in swarm.serving(st).values()}

        st = wait_for(url, training_again, poll=0.05)
        victim = next(p for p, (s, _) in swarm.serving(st).items() if s == 1)
        swarm.peers[victim].signal(signal.SIGKILL)
        coord.wait_line(r"rolling back to the checkpoint of step [1-9]\d* ", 60)
        swarm.note_children()
        assert coord.wait(120) == 0, coord.output[-3000:]
    finally:
        swarm.close()
    assert compare_checkpoints(out, ref) <= 1e-5


# hf:DATASET inputs (Hugging Face datasets, the test extra): written by the test, read offline


def _hf_texts(texts: dict[str, str]) -> list[str]:
    return [texts[k] for k in sorted(texts)]


def test_an_hf_dataset_makes_the_shards_of_its_texts_as_files(
    tmp_path: Path, bpe: Path, corpus: tuple[Path, dict[str, str]]
) -> None:
    import datasets

    from zoo.prepare import PrepareOptions, prepare

    texts = _hf_texts(corpus[1])
    files = tmp_path / "files"
    files.mkdir()
    for i, text in enumerate(texts):
        (files / f"doc{i:03d}.txt").write_text(text)
    table = datasets.Dataset.from_dict({"id": list(range(len(texts))), "body": texts})
    table.save_to_disk(str(tmp_path / "saved"))
    table.to_parquet(str(tmp_path / "parquet" / "train-00000.parquet"))
    tokenizer = str(bpe / "tokenizer.json")
    flags = ["--tokenizer", tokenizer, "--val-fraction", "0.1"]
    r = run_cli("data", "prepare", f"hf:{tmp_path / 'saved'}", "-o", str(tmp_path / "saved-out"), *flags)
    assert r.returncode == 0, r.stderr
    inputs = {"files-out": str(files), "parquet-out": f"hf:{tmp_path / 'parquet'}:train@body"}
    for out, source in inputs.items():
        prepare(PrepareOptions([source], tmp_path / out, tokenizer, 0, 0.1))
    want = ShardMeta.read(tmp_path / "files-out")
    assert want.splits["val"].documents == 3 and want.splits["train"].documents == 27
    for out in ("saved-out", "parquet-out"):
        got = ShardMeta.read(tmp_path / out)
        assert got.splits == want.splits and got.source_bytes == want.source_bytes == len("".join(texts).encode())
        for split in ("train", "val"):
            assert np.array_equal(_ids(tmp_path / out, split), _ids(tmp_path / "files-out", split))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Datasets the bad-input table reads: two string columns and a number, a saved
    DatasetDict, an empty table."""
    import datasets

    root = tmp_path_factory.mktemp("hf")
    datasets.Dataset.from_dict({"title": ["a", "b"], "body": ["x y", "z"], "n": [1, 2]}).save_to_disk(str(root / "two"))
    pair = {"train": datasets.Dataset.from_dict({"text": ["one", "two"]})}
    datasets.DatasetDict(pair).save_to_disk(str(root / "dict"))
    empty = datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")}))
    empty.save_to_disk(str(root / "empty"))
    empty.to_parquet(str(root / "emptypq" / "train.parquet"))
    return root


# the cases' ids wrapped to a few lines, not one to a line (fmt: skip below)
@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("two@nosuch", "no column 'nosuch'; it has title, body, n"),
        ("two@n", "column 'n' is not text"),
        ("two", "which column is the text? name it with @COLUMN (string columns: title, body)"),
        ("dict:test", "no split 'test'; it has train"),
        ("two:validation@body", "holds one table"),
        ("empty", "the dataset is empty"),
        ("emptypq", "the dataset is empty"),
        ("nobody-here/no-such-dataset", "HF_DATASETS_OFFLINE=1"),
        ("two@", "not hf:NAME[#CONFIG][:SPLIT][@COLUMN]"),
    ],
    ids=["unknown-column", "number-column", "no-text-column", "missing-split", "split-of-one-table", "empty",
         "empty-parquet", "not-cached", "syntax"],
)  # fmt: skip
def test_bad_hf_inputs_are_one_line_exit_2(tmp_path: Path, hf_folders: Path, spec: str, needle: str) -> None:
    name = spec if spec.startswith("nobody") else f"{hf_folders}/{spec}"
    _one_line_exit_2(["data", "prepare", f"hf:{name}", "-o", str(tmp_path / "out")], needle)


def test_hf_syntax_is_checked_before_anything_heavy_is_imported() -> None:
    import subprocess
    import sys

    code = (
        "import json, sys\nfrom fusionllm.cli import build_parser\n"
        "build_parser().parse_args(['data', 'prepare', 'hf:owner/name#cfg:test@body', 'x.txt', '-o', 'out'])\n"
        "try:\n    build_parser().parse_args(['data', 'prepare', 'hf:name#', '-o', 'out'])\n"
        "except SystemExit as exc:\n    print(exc.code)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'datasets'})))"
    )
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert r.stdout.split() == ["2", "[]"], r.stderr
    assert r.stderr.count("\n") == 1 and "an empty part" in r.stderr


def test_without_datasets_an_hf_input_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from zoo.corpus import Corpus
    from zoo.shards import ShardError

    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it fails as where it is not installed
    with pytest.raises(ShardError, match=r"pip install 'fusionllm\[hf\]'"):
        Corpus.scan(["hf:some/dataset"])
