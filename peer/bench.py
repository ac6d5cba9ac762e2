"""Measuring the peer's device: matmul throughput in the training dtype and free memory."""

from __future__ import annotations

import time

import psutil
import torch


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_problem(requested: str) -> str | None:
    """Why ``--device requested`` cannot train here (one line), or None: a peer lends a
    CPU, a CUDA GPU this machine has, or Apple's MPS."""
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        return f"--device {requested!r}: not a device; use cpu, cuda, cuda:N or mps"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {requested}: this machine has no CUDA GPU that torch can use"
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return f"--device {requested}: this machine has {torch.cuda.device_count()} CUDA GPUs (cuda:0 ...)"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return f"--device {requested}: MPS is not available here"
    if device.type not in ("cpu", "cuda", "mps"):
        return f"--device {requested}: a peer trains on cpu, cuda or mps"
    return None


def measure_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.3, throttle: float = 1.0
) -> float:
    """Sustained FLOP/s of square matmuls on ``device``; a peer throttled to a fraction
    ``throttle`` of its speed (see peer.throttle) reports that fraction of it."""
    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm-up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            c = a @ b
        iters += 4
        if device.type == "cuda":
            torch.cuda.synchronize()
    del c
    return throttle * 2 * n**3 * iters / (time.perf_counter() - start)


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)
