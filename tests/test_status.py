"""The coordinator's status page, JSON API, metrics and `fusionllm status`, during
a live 3-peer demo; the page is checked in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.status import StatusBoard
from tests.conftest import ROOT, run_cli

SMALL = ["--model-args", "n_layer=2,n_embd=64,n_head=4"]


# ------------------------------------------------------------------ the board, pure


def _ad(device: str = "cpu", maddr: str = "/ip4/1.2.3.4/tcp/5") -> SimpleNamespace:
    return SimpleNamespace(device=device, flops=2e10, up_mbps=100.0, down_mbps=200.0, maddrs=[maddr])


def test_board_tracks_peers_health_plan_and_training() -> None:
    now = [1000.0]
    board = StatusBoard("run", steps=10, clock=lambda: now[0])
    board.saw_adverts({"a": _ad(), "b": _ad(maddr="/ip4/1.2.3.4/tcp/5/p2p/X/p2p-circuit")})
    board.set_plan(
        [5, 0, 7, 9], [{"first_op": 0, "last_op": 1}, {"first_op": 2, "last_op": 3}], [2], [4096], [["a"], ["b"]]
    )
    board.set_links(["adatopk:0.1"], [8.0])
    for step in range(4):
        now[0] += 2
        board.heard_from("a")
        board.step_done(step, 3.0 - step / 10, 2.0, 1000, [(100 * (step + 1), 1000 * (step + 1))])
    st = board.state()
    peers = {p["id"]: p for p in st["peers"]}
    assert peers["a"]["stage"] == 0 and peers["b"]["stage"] == 1
    assert peers["b"]["connection"] == "relayed" and peers["a"]["connection"] == "direct"
    assert peers["a"]["health"] == "ok" and peers["b"]["health"] == "ok"
    assert st["training"]["step"] == 4 and st["training"]["losses"][-1] == [3, 2.7]
    assert st["training"]["tokens_per_s"] == 500.0 and st["training"]["eta_s"] == 12.0
    assert st["links"][0]["ratio"] == 10.0 and st["plan"]["cuts"][0]["codec"] == "adatopk:0.1"
    now[0] += 25
    assert {p["id"]: p["health"] for p in board.state()["peers"]} == {"a": "late", "b": "silent"}
    board.saw_adverts({"a": _ad()})
    assert {p["id"]: p["health"] for p in board.state()["peers"]}["b"] == "left"
    board.reject("x", "bad_signature", "the signature does not verify")
    kinds = [e["kind"] for e in board.state()["events"]]
    assert kinds == ["join", "join", "plan", "links", "leave", "rejected"]
    assert board.state()["rejected"] == {"bad_signature": 1}


def test_board_thins_a_long_loss_chart_evenly() -> None:
    board = StatusBoard("run", steps=100_000)
    for step in range(10_000):
        board.step_done(step, 1.0, 0.1, 1, [])
    points = board.state()["training"]["losses"]
    assert len(points) <= 2000 and points[0][0] == 0
    gaps = {b[0] - a[0] for a, b in zip(points, points[1:])}
    assert len(gaps) == 1, "evenly spaced"


# ------------------------------------------------------------------ a live run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def _state(base: str) -> dict:
    code, body, _ = _get(base + "api/v1/state")
    assert code == 200
    return json.loads(body)


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-peer demo training for a long time; yields the status page's URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("live") / "demo.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fusionllm", "demo", "--peers", "3", "--steps", "100000", *SMALL,
             "--status-port", str(port), "--save", str(log.with_suffix(".safetensors"))],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}/"
    try:
        _wait(lambda: f"status page: {base}" in log.read_text(errors="replace"), 60, "the status URL")
        _wait(lambda: _state(base)["training"]["step"] >= 3, 120, "training to start")
        yield base
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_api_state_during_a_run(live: str) -> None:
    st = _state(live)
    assert st["version"] == 1 and st["phase"] == "training"
    peers = st["peers"]
    assert len(peers) == 3 and sorted(p["stage"] for p in peers) == [0, 1, 2]
    for p in peers:
        assert {"id", "device", "flops", "up_mbps", "down_mbps", "connection", "stage", "replica", "last_seen"} <= set(
            p
        )
        assert p["health"] == "ok" and p["connection"] == "direct" and p["flops"] > 0
    plan = st["plan"]
    assert len(plan["stages"]) == 3 and len(plan["cuts"]) == 2 and plan["num_ops"] == len(plan["op_flops"])
    assert all(c["bytes"] > 0 and c["codec"] == "none" for c in plan["cuts"])
    tr = st["training"]
    assert tr["steps"] == 100000 and tr["loss"] > 0 and tr["tokens_per_s"] > 0 and len(tr["losses"]) == tr["step"]
    assert [link["boundary"] for link in st["links"]] == [0, 1] and st["links"][0]["wire_bytes"] > 0
    assert [e["kind"] for e in st["events"]][:4] == ["join", "join", "join", "plan"]
    _wait(lambda: _state(live)["training"]["step"] > tr["step"], 30, "the next step")


def test_metrics_in_prometheus_text(live: str) -> None:
    code, body, ctype = _get(live + "metrics")
    assert code == 200 and ctype.startswith("text/plain")
    text = body.decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["fusionllm_step"] >= 3 and values["fusionllm_loss"] > 0
    assert values['fusionllm_peers{health="ok"}'] == 3.0
    assert values['fusionllm_link_wire_bytes_total{boundary="0"}'] > 0
    assert "# TYPE fusionllm_rejected_messages_total counter" in text


def test_bad_paths_404_and_nothing_changes_state(live: str) -> None:
    for path in ("nope", "api/v1/nope", "api/v2/state", "static/secret.py", "static/../swarm.py", "metrics/x"):
        assert _get(live + path)[0] == 404, path
    before = _state(live)
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        req = urllib.request.Request(live + "api/v1/state", data=b"{}", method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 405, method
    for _ in range(5):  # reads change nothing either
        _get(live)
        _get(live + "metrics")
    after = _state(live)
    assert after["events"] == before["events"] and after["peers"] == [
        {**p, "last_seen": q["last_seen"], "health": q["health"]} for p, q in zip(before["peers"], after["peers"])
    ]
    assert after["training"]["step"] >= before["training"]["step"]


def test_status_command_prints_the_page(live: str) -> None:
    r = run_cli("status", "--coordinator", live)
    assert r.returncode == 0, r.stderr
    assert "training" in r.stdout and "step " in r.stdout
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("12D3KooW")) == 3
    assert "boundary 0 -> 1: none" in r.stdout
    r = run_cli("status", "--coordinator", f"http://127.0.0.1:{_free_port()}")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot read the status" in r.stderr


def _chrome():  # type: ignore[no-untyped-def]
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_page_in_headless_chromium(live: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    browser = _chrome()
    try:
        browser.get(live)
        rows = lambda: browser.find_elements(By.CSS_SELECTOR, "#peers tbody tr")  # noqa: E731
        _wait(lambda: len(rows()) == 3, 30, "three peer rows")
        assert sorted(r.get_attribute("data-stage") for r in rows()) == ["0", "1", "2"]
        points = lambda: int(browser.find_element(By.ID, "loss-chart").get_attribute("data-points"))  # noqa: E731
        first = points()
        assert first >= 1
        _wait(lambda: points() > first, 30, "the loss chart to gain points")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#plan .stage-band")) == 3
        assert len(browser.find_elements(By.CSS_SELECTOR, "#links tbody tr")) == 2
        resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(url.startswith(live) for url in resources), resources
        shot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        target = os.environ.get("FUSIONLLM_SCREENSHOT")
        if target:
            shutil.copy(shot, target)
    finally:
        browser.quit()
