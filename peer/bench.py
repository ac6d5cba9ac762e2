"""Measuring the peer's device: matmul throughput in the training dtype and free memory."""

from __future__ import annotations

import time

import psutil
import torch


def one_cpu_thread(device: torch.device) -> bool:
    """Whether ``device``'s work runs on the calling thread alone (a CPU, torch on one
    thread): its CPU time is then the work done, whatever the wait for a core."""
    return device.type == "cpu" and torch.get_num_threads() == 1


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
    ``throttle`` of its speed (see peer.throttle) reports that fraction of it. On one
    CPU thread the matmuls' CPU time is the divisor, not their wall time: the speed of
    one of the machine's threads while it has a core. Peers that share a machine
    measure at once while others start; by wall time the README demo's four read one
    thread at 14 to 87 GFLOP/s, and its plan followed that noise. How many share the
    cores is the planner's (``coordinator.host_share``, from the advert's ``cores``
    and ``host_cores``)."""
    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm-up
    one_thread = one_cpu_thread(device)
    iters, start, cpu_start = 0, time.perf_counter(), time.thread_time() if one_thread else 0.0
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            c = a @ b
        iters += 4
        if device.type == "cuda":
            torch.cuda.synchronize()
    del c
    wall = time.perf_counter() - start
    took = time.thread_time() - cpu_start if one_thread else wall
    return throttle * 2 * n**3 * iters / max(took, 1e-9)


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)
