"""A run's directory: checkpoints (one safetensors file per stage) and the run's
history in SQLite (metadata, checkpoint rows, losses, events). Local I/O only.

A checkpoint directory is written under a temporary name, fsynced, renamed into
place and only then recorded in SQLite, so a crash at any point leaves the
previous checkpoint usable and a half-written directory is never taken for one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
CHECKPOINTS = "checkpoints"
DB_NAME = "run.sqlite"
_TMP = ".tmp-"
_counter = itertools.count()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, created_at REAL NOT NULL, dir TEXT NOT NULL,
    cut TEXT NOT NULL, stages TEXT NOT NULL, codecs TEXT NOT NULL, bytes INTEGER NOT NULL, files TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS losses (step INTEGER PRIMARY KEY, loss REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, kind TEXT NOT NULL,
    text TEXT NOT NULL);
"""


class CheckpointError(RuntimeError):
    """An unreadable or corrupt run directory or checkpoint; ``str()`` is one line."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    epoch: int
    path: Path
    cut: tuple[int, ...]
    stages: tuple[tuple[str, ...], ...]  # peer ids serving each stage
    codecs: Any  # as the coordinator passed it (JSON)
    created_at: float
    nbytes: int
    files: tuple[tuple[str, int], ...] = ()  # (file name, size) per stage, in stage order


def default_run_dir(run_id: str) -> Path:
    """``~/.fusionllm/runs/<run_id>``, the id made a safe directory name (with a hash
    of the original appended when anything had to change)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id).lstrip(".")[:80]
    if safe != run_id or not safe:
        safe = f"{safe or 'run'}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"
    return Path.home() / ".fusionllm" / "runs" / safe


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _fsync(path: Path) -> None:
    """Flush a file or (on POSIX) a directory to disk."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunDir:
    """One run's directory. The constructor does no I/O; :meth:`open` creates the
    tree and the database (and removes stale temporary checkpoint directories).
    One process writes a run directory at a time."""

    def __init__(self, path: str | Path, keep: int = 2, clock: Callable[[], float] = time.time) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.path = Path(path).expanduser()
        self.keep = keep
        self.clock = clock
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # guards the connection: saving may run in worker threads
        self._save_lock = threading.Lock()  # one checkpoint write (and prune) at a time

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    # ---- lifecycle

    def open(self) -> RunDir:
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path / DB_NAME, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema {version} is newer than this version's {SCHEMA_VERSION}")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            db.close()
            raise CheckpointError(f"cannot open {self.path / DB_NAME}: {_one_line(exc)}") from None
        self._db = db
        for stale in self.checkpoints_dir.glob(f"*{_TMP}*"):
            log.info("removing the half-written checkpoint %s", stale.name)
            shutil.rmtree(stale, ignore_errors=True)
        return self

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> RunDir:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("RunDir.open() was not called")
        return self._db

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        with self._lock, self.db:
            self.db.execute(sql, args)

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    # ---- metadata, losses, events

    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable value under ``key`` (replacing any old one)."""
        self._write("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str, default: Any = None) -> Any:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def record_loss(self, step: int, loss: float) -> None:
        """Record step ``step``'s loss without syncing the disk: the coordinator's loop
        writes it once the step's commits are out, while the next step's first stage
        waits on nothing else, where a sync took 8.6 ms (median, this machine; 0.012 ms
        unsynced). The write-ahead log keeps it
        across a crash of the process; the next synced write (a checkpoint's) makes it
        and every earlier one durable in order, and a resume replays the steps after
        the last checkpoint, whose losses alone a power cut could lose."""
        with self._lock:
            self.db.execute("PRAGMA synchronous=NORMAL")
            try:
                with self.db:
                    self.db.execute("INSERT OR REPLACE INTO losses (step, loss) VALUES (?, ?)", (step, float(loss)))
            finally:
                self.db.execute("PRAGMA synchronous=FULL")

    def truncate_losses(self, after_step: int) -> None:
        """Forget the losses of steps after ``after_step`` (a rollback replays them)."""
        self._write("DELETE FROM losses WHERE step > ?", (after_step,))

    def losses(self) -> list[float]:
        return [loss for (loss,) in self._read("SELECT loss FROM losses ORDER BY step")]

    def add_event(self, kind: str, text: str) -> None:
        self._write("INSERT INTO events (t, kind, text) VALUES (?, ?, ?)", (self.clock(), kind, text))

    def events(self, limit: int = 200) -> list[dict[str, Any]]:
        """The last ``limit`` events, oldest first, as ``{"t", "kind", "text"}``."""
        rows = self._read("SELECT t, kind, text FROM events ORDER BY id DESC LIMIT ?", (limit,))
        return [{"t": t, "kind": k, "text": x} for t, k, x in reversed(rows)]

    # ---- checkpoints

    def save_checkpoint(
        self, step: int, epoch: int, stages: list[dict[str, torch.Tensor]], info: dict[str, Any]
    ) -> CheckpointInfo:
        """Write one safetensors file per stage and record the checkpoint.

        ``info`` may hold ``cut`` (a list of boundaries or a ``Cut``), ``stages``
        (peer ids per stage) and ``codecs`` (JSON). A checkpoint at ``step``
        replaces an older one at the same step; only the newest ``keep`` steps are
        kept. Thread-safe: concurrent saves are written one after another.
        """
        if not stages:
            raise ValueError("a checkpoint needs at least one stage")
        cut = info.get("cut") or []
        cut = tuple(cut.to_list() if hasattr(cut, "to_list") else cut)
        peers = tuple(tuple(p) for p in info.get("stages") or [[] for _ in stages])
        codecs = json.dumps(info.get("codecs"))  # a value JSON refuses fails before anything is written
        db, start = self.db, time.perf_counter()
        with self._save_lock:
            final, files = self._write_dir(f"step-{step:08d}", step, stages)
            nbytes = sum(size for _, size in files)
            ckpt = CheckpointInfo(step, epoch, final, cut, peers, json.loads(codecs), self.clock(), nbytes, files)
            with self._lock, db:
                db.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        step,
                        epoch,
                        ckpt.created_at,
                        final.name,
                        json.dumps(cut),
                        json.dumps(peers),
                        codecs,
                        nbytes,
                        json.dumps(files),
                    ),
                )
            self._prune()
        elapsed = time.perf_counter() - start
        log.info("checkpoint %s: %d stages, %d bytes, %.2f s", final.name, len(files), nbytes, elapsed)
        return ckpt

    def _write_dir(
        self, name: str, step: int, stages: list[dict[str, torch.Tensor]]
    ) -> tuple[Path, tuple[tuple[str, int], ...]]:
        """Write the stage files under a temporary name, fsync, rename to a fresh
        ``name`` (``name.vN`` when re-saving a step) and fsync the parent."""
        tmp = self.checkpoints_dir / f"{name}{_TMP}{os.getpid()}-{next(_counter)}"
        tmp.mkdir()
        try:
            files = []
            for s, tensors in enumerate(stages):
                path = tmp / f"stage-{s}.safetensors"
                save_file(tensors, str(path), metadata={"step": str(step), "stage": str(s)})
                _fsync(path)
                files.append((path.name, path.stat().st_size))
            _fsync(tmp)
            final = self.checkpoints_dir / name
            for n in itertools.count(2):  # never rename over a recorded checkpoint
                if not final.exists():
                    break
                final = self.checkpoints_dir / f"{name}.v{n}"
            os.rename(tmp, final)
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync(self.checkpoints_dir)
        return final, tuple(files)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Recorded checkpoints, newest first (their files not checked)."""
        rows = self._read("SELECT * FROM checkpoints ORDER BY step DESC")
        return [self._info(row) for row in rows]

    def latest(self) -> CheckpointInfo | None:
        """The newest recorded checkpoint whose stage files are all there, with their sizes."""
        for ckpt in self.checkpoints():
            if all((ckpt.path / f).is_file() and (ckpt.path / f).stat().st_size == n for f, n in ckpt.files):
                return ckpt
            log.warning("checkpoint %s is incomplete on disk; skipping it", ckpt.path.name)
        return None

    def drop_after(self, step: int) -> None:
        """Forget the checkpoints of more than ``step`` steps (they hold an update that
        a spot check found untrustworthy), so neither a rollback nor a resume uses them."""
        with self._lock, self.db:
            self.db.execute("DELETE FROM checkpoints WHERE step > ?", (step,))
        self._prune()

    def load(self, info: CheckpointInfo) -> dict[str, torch.Tensor]:
        """All stages' tensors of a checkpoint merged into one dict."""
        merged: dict[str, torch.Tensor] = {}
        for f, _ in info.files:
            try:
                merged.update(load_file(str(info.path / f)))
            except Exception as exc:  # safetensors raises its own error types and OSError
                raise CheckpointError(f"cannot read checkpoint file {info.path / f}: {_one_line(exc)}") from None
        return merged

    def _info(self, row: tuple[Any, ...]) -> CheckpointInfo:
        step, epoch, created_at, dirname, cut, stages, codecs, nbytes, files = row
        try:
            return CheckpointInfo(
                step=step,
                epoch=epoch,
                path=self.checkpoints_dir / dirname,
                cut=tuple(json.loads(cut)),
                stages=tuple(tuple(p) for p in json.loads(stages)),
                codecs=json.loads(codecs),
                created_at=created_at,
                nbytes=nbytes,
                files=tuple((f, n) for f, n in json.loads(files)),
            )
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"checkpoint row of step {step} is corrupt: {_one_line(exc)}") from None

    def _prune(self) -> None:
        """Drop all but the newest ``keep`` checkpoints, then any directory no row names."""
        with self._lock, self.db:
            self.db.execute(
                "DELETE FROM checkpoints WHERE step NOT IN (SELECT step FROM checkpoints ORDER BY step DESC LIMIT ?)",
                (self.keep,),
            )
        recorded = {row[0] for row in self._read("SELECT dir FROM checkpoints")}
        for d in self.checkpoints_dir.glob("step-*"):
            if d.name not in recorded and _TMP not in d.name:
                log.info("removing old checkpoint %s", d.name)
                shutil.rmtree(d, ignore_errors=True)
