from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``fusionllm`` in a fresh interpreter and capture its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "fusionllm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=env,
    )


@pytest.fixture
def cli():
    return run_cli
