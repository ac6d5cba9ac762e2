"""The coordinator's status page, JSON API, metrics and `fusionllm status`, during
a live 3-peer demo; the page is checked in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.status import CLAIM_SLACK, MAX_REJECTED_EVENTS, StatusBoard, finite_json
from coordinator.web import CLOSE_WAIT_S, StatusServer
from coordinator.webserve import metrics_text
from fusionllm.commands import render_status
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


_STAGES = [
    {"first_op": 0, "last_op": 1, "flops": 5, "param_bytes": 1000},
    {"first_op": 2, "last_op": 3, "flops": 16, "param_bytes": 2000},
]


def _planned_board(now: list[float]) -> StatusBoard:
    """Peers a, b, c planned as stages 0, 1, 1 (c a replica); d known but unplanned; 6 steps done."""
    board = StatusBoard("run", steps=20, clock=lambda: now[0])
    board.saw_adverts({pid: _ad() for pid in "abcd"})
    assert {p["id"]: p["state"] for p in board.state()["peers"]} == dict.fromkeys("abcd", "joined")
    board.set_epoch(1, "first plan")
    board.set_plan([5, 0, 7, 9], _STAGES, [2], [4096], [["a"], ["b", "c"]])
    board.set_links(["none"], [100.0])
    for step in range(6):
        now[0] += 1
        board.step_done(step, 3.0 - step / 10, 1.0, 100, [(10, 10)])
    return board


def test_board_plan_marks_peers_serving_or_standby() -> None:
    board = _planned_board([1000.0])
    st = board.state()
    assert {p["id"]: p["state"] for p in st["peers"]} == {
        "a": "serving",
        "b": "serving",
        "c": "serving",
        "d": "standby",
    }
    assert {p["id"]: (p["stage"], p["replica"]) for p in st["peers"]}["c"] == (1, 1)
    assert st["training"]["epoch"] == 1 and st["recovery"] == {
        "epoch": 1,
        "failures": 0,
        "rollbacks": 0,
        "steps_redone": 0,
        "spot_checks": 0,
    }
    assert st["checkpoint"] is None
    assert [e["kind"] for e in st["events"]] == ["join"] * 4 + ["epoch", "plan", "links"]
    with pytest.raises(ValueError, match="not one of"):
        board.peer_state("a", "asleep")
    board.peer_state("nobody", "lost")  # unknown peers are ignored
    assert "nobody" not in {p["id"] for p in board.state()["peers"]}


def test_board_failure_replace_rollback_checkpoint() -> None:
    now = [1000.0]
    board = _planned_board(now)
    board.checkpoint(4, "/runs/r/ckpt-4", 1.25, 12_000_000)
    assert board.state()["checkpoint"] == {
        "step": 4,
        "path": "/runs/r/ckpt-4",
        "at": now[0],
        "seconds": 1.25,
        "bytes": 12_000_000,
    }
    board.failure("b", "step 6, stage 1 backward", "connection reset")
    board.replaced(1, "b", "d")
    board.rollback(4, "peer b lost; stage 1 restored from the checkpoint")
    board.set_epoch(2, "replaced b")
    st = board.state()
    peers = {p["id"]: p for p in st["peers"]}
    assert peers["b"]["state"] == "lost" and peers["b"]["stage"] is None
    assert (peers["d"]["state"], peers["d"]["stage"], peers["d"]["replica"]) == ("serving", 1, 0)
    assert st["plan"]["stages"][1]["peers"] == ["d", "c"]
    assert st["training"]["step"] == 4 and st["training"]["epoch"] == 2
    assert [p[0] for p in st["training"]["losses"]] == [0, 1, 2, 3] and st["training"]["loss"] == 2.7
    assert st["recovery"] == {"epoch": 2, "failures": 1, "rollbacks": 1, "steps_redone": 2, "spot_checks": 0}
    assert [e["kind"] for e in st["events"]][-5:] == ["checkpoint", "failure", "replace", "rollback", "epoch"]
    assert "connection reset" in st["events"][-4]["text"]
    for step in range(4, 8):  # the redone steps come back on the chart, once each
        board.step_done(step, 2.0, 1.0, 100, [(10, 10)])
    assert [p[0] for p in board.state()["training"]["losses"]] == list(range(8))


def test_a_lost_peer_stays_lost_until_planned_again_or_standby() -> None:
    now = [1000.0]
    board = _planned_board(now)
    board.failure("c", "step 6", "timed out")
    board.failure("ghost", "step 6", "never advertised")  # counted, nothing else
    board.saw_adverts({pid: _ad() for pid in "abd"})  # c's advert expires...
    board.saw_adverts({pid: _ad() for pid in "abcd"})  # ...and c joins again
    states = lambda: {p["id"]: p["state"] for p in board.state()["peers"]}  # noqa: E731
    assert states()["c"] == "lost" and board.state()["recovery"]["failures"] == 2
    board.set_plan([1, 1], [{"first_op": 0, "last_op": 0}, {"first_op": 1, "last_op": 1}], [1], [8], [["a"], ["b"]])
    assert states() == {"a": "serving", "b": "serving", "c": "lost", "d": "standby"}
    board.peer_state("c", "standby")
    assert states()["c"] == "standby"
    board.failure("c", "standby", "gone again")
    board.set_plan([1, 1], [{"first_op": 0, "last_op": 0}, {"first_op": 1, "last_op": 1}], [1], [8], [["c"], ["b"]])
    assert states() == {"a": "standby", "b": "serving", "c": "serving", "d": "standby"}


def test_a_resumed_board_shows_the_history_to_its_checkpoint() -> None:
    board = StatusBoard("run", steps=10_000, clock=lambda: 5.0)
    board.restore_losses([4.0 - i / 5000 for i in range(5000)])
    board.resumed(5000, "/runs/r")
    tr = board.state()["training"]
    assert tr["step"] == 5000 and tr["loss"] == pytest.approx(4.0 - 4999 / 5000)
    assert len(tr["losses"]) <= 2000 and tr["losses"][0] == [0, 4.0]
    assert len({b[0] - a[0] for a, b in zip(tr["losses"], tr["losses"][1:])}) == 1, "evenly spaced"
    assert board.state()["events"][-1] == {
        "t": 5.0,
        "kind": "resume",
        "text": "coordinator resumed /runs/r at step 5000",
    }


def test_a_flood_of_rejections_does_not_push_out_a_failure() -> None:
    now = [1000.0]
    board = _planned_board(now)
    board.failure("b", "step 6", "stalled")
    for i in range(1000):
        now[0] += 0.01
        board.reject("x", "bad_signature", f"message {i}")
        if i % 2 == 0:  # routine checkpoints do not push it out either
            board.checkpoint(i, f"/runs/r/ckpt-{i}", 0.5, 1000)
            board.event("check", f"rebalance check at step {i}: the plan on measured speeds is the current one")
    board.checkpoint(6, "/runs/r/ckpt-6", 0.5, 1000)
    events = board.state()["events"]
    kinds = [e["kind"] for e in events]
    assert kinds.count("rejected") == MAX_REJECTED_EVENTS and kinds.count("checkpoint") == kinds.count("check") == 20
    assert events[-2]["text"].endswith("message 999") and kinds[-1] == "checkpoint"
    assert kinds[:9] == ["join"] * 4 + ["epoch", "plan", "links", "failure", "rejected"]
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    assert board.state()["rejected"] == {"bad_signature": 1000}


def test_metrics_show_the_step_breakdown_per_stage() -> None:
    board = _planned_board([1000.0])
    board.set_breakdown(
        [
            {"stage": 0, "measured_ms": {"forward": 12.5, "wire": 3.0, "step": 40.0}, "predicted_ms": {"step": 35.0}},
            {"stage": 1, "measured_ms": {"backward": 20.0}, "predicted_ms": {}},
        ]
    )
    text = metrics_text(finite_json(board.state())).decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert values['fusionllm_step_part_seconds{part="forward",stage="0"}'] == 0.0125
    assert values['fusionllm_step_part_seconds{part="step",stage="0"}'] == 0.04
    assert values['fusionllm_step_part_seconds{part="backward",stage="1"}'] == 0.02
    assert values['fusionllm_step_part_predicted_seconds{part="step",stage="0"}'] == 0.035
    assert not any('stage="1"' in k for k in values if k.startswith("fusionllm_step_part_predicted"))


def test_metrics_show_recovery() -> None:
    now = [1000.0]
    board = _planned_board(now)
    board.failure("b", "step 6", "stalled")
    board.rollback(4, "b lost")
    board.checkpoint(4, "/runs/r/ckpt-4", 0.5, 1000)
    board.evaluated(4, 4.5)
    text = metrics_text(finite_json(board.state())).decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert values["fusionllm_epoch"] == 1 and values["fusionllm_checkpoint_step"] == 4
    assert values["fusionllm_validation_loss"] == 4.5 and board.state()["training"]["val_losses"] == [[4, 4.5]]
    assert values["fusionllm_peer_failures_total"] == 1 and values["fusionllm_rollbacks_total"] == 1
    assert values["fusionllm_steps_redone_total"] == 2 and values["fusionllm_step"] == 4
    assert values['fusionllm_peer_states{state="lost"}'] == 1 and values['fusionllm_peer_states{state="serving"}'] == 2
    assert (
        values['fusionllm_peer_states{state="standby"}'] == 1 and values['fusionllm_peer_states{state="joined"}'] == 0
    )


def test_terminal_view_shows_recovery_and_strips_control_characters() -> None:
    now = [1000.0]
    board = _planned_board(now)
    board.saw_adverts({**{pid: _ad() for pid in "abcd"}, "e": _ad(device="gpu\x1b[2J\x07\u202e")})
    board.failure("b", "step 6", "reset\x1b]0;pwned\x07")
    board.set_epoch(2, "replaced b")
    board.checkpoint(4, "/runs/r/ckpt-4", 0.5, 3_000_000)
    now[0] += 90
    text = render_status(board.state())
    assert "epoch 2  failures 1  rollbacks 0  steps redone 0" in text
    assert "last checkpoint: step 4, 3.00 MB in 0.5 s, 1m30s ago: /runs/r/ckpt-4" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1] in "abcde" and line[1:2] == " "}
    assert {pid: row[5] for pid, row in rows.items()} == {
        "a": "serving",
        "b": "lost",
        "c": "serving",
        "d": "standby",
        "e": "joined",
    }
    assert not any(ord(ch) < 32 and ch != "\n" or 0x7F <= ord(ch) <= 0x9F or ch == "\u202e" for ch in text)
    assert "reset]0;pwned" in text and "epoch 2: replaced b" in text


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


def _step(base: str) -> int:
    """The run's step, or -1 while the page does not answer in time (a busy machine
    can keep a request to a coordinator setting its run up waiting past its timeout)."""
    try:
        return _state(base)["training"]["step"]
    except OSError:
        return -1


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
    # the page is checked against the first plan's three stages: no rebalancing (on by default;
    # on two cores one process of this small model can beat the pipeline, and CI saw it move at step 25)
    demo = [sys.executable, "-m", "fusionllm", "demo", "--peers", "3", "--steps", "100000", "--rebalance-every", "0"]
    demo += SMALL
    cmd = [*demo, "--status-port", str(port), "--save", str(log.with_suffix(".safetensors"))]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}/"

    def running() -> str:
        out = log.read_text(errors="replace")
        assert proc.poll() is None, f"the demo exited: {out[-3000:]}"
        return out

    try:
        _wait(lambda: f"status page: {base}" in running(), 60, "the status URL")
        _wait(lambda: running() and _step(base) >= 3, 120, "training to start")
        yield base
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"


@pytest.fixture(scope="module")
def recovering() -> Iterator[str]:
    """The status page of a board (on its own thread and loop) that lost a peer, replaced
    it, rolled back and re-planned; one peer's device is hostile HTML. Yields the URL."""
    now = [time.time() - 60]
    board = _planned_board(now)
    board.clock = time.time
    board.saw_adverts({**{pid: _ad() for pid in "abcd"}, "e": _ad(device=HOSTILE)})
    board.checkpoint(4, "/runs/r/ckpt-4", 1.5, 12_000_000)
    board.evaluated(2, 5.25)
    board.evaluated(6, 5.0)  # undone by the rollback to step 4
    board.failure("b", "step 6, stage 1", HOSTILE)
    board.replaced(1, "b", "d")
    board.rollback(4, "stage 1 restored from the checkpoint")
    board.set_epoch(2, "b lost; d serves stage 1")
    board.step_done(4, float("nan"), 1.0, 100, [(10, 10)])  # poisoned: shown as NaN, left off the chart
    for _ in range(300):
        board.reject("e", "bad_signature", HOSTILE)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = StatusServer(board, port=0)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield server.url
    finally:
        asyncio.run_coroutine_threadsafe(server.aclose(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


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
        assert p["state"] == "serving"
    assert st["recovery"]["failures"] == 0 and st["recovery"]["epoch"] == st["training"]["epoch"]
    plan = st["plan"]
    assert len(plan["stages"]) == 3 and len(plan["cuts"]) == 2 and plan["num_ops"] == len(plan["op_flops"])
    assert all(c["bytes"] > 0 and c["codec"] == "none" for c in plan["cuts"])
    tr = st["training"]
    assert tr["steps"] == 100000 and tr["loss"] > 0 and tr["tokens_per_s"] > 0 and len(tr["losses"]) == tr["step"]
    assert [link["boundary"] for link in st["links"]] == [0, 1] and st["links"][0]["wire_bytes"] > 0
    assert [e["kind"] for e in st["events"]][:5] == ["join", "join", "join", "epoch", "plan"]
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
    assert values['fusionllm_peer_states{state="serving"}'] == 3.0 and values["fusionllm_peer_failures_total"] == 0


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
    moving = ("last_seen", "health", "measured_flops")  # what the run itself updates as it goes
    assert after["events"] == before["events"] and after["peers"] == [
        {**p, **{k: q[k] for k in moving if k in q}} for p, q in zip(before["peers"], after["peers"])
    ]
    assert after["training"]["step"] >= before["training"]["step"]


def test_status_command_prints_the_page(live: str) -> None:
    """(The command against the page and against a port nobody serves run side by side.)"""
    with ThreadPoolExecutor(2) as pool:
        page = pool.submit(run_cli, "status", "--coordinator", live)
        nobody = pool.submit(run_cli, "status", "--coordinator", f"http://127.0.0.1:{_free_port()}")
    r = page.result()
    assert r.returncode == 0, r.stderr
    assert "training" in r.stdout and "step " in r.stdout
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("12D3KooW")) == 3
    assert "boundary 0 -> 1: none" in r.stdout and "failures 0" in r.stdout
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("12D3KooW") and " serving " in line) == 3
    r = nobody.result()
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


# One synchronous read of what the page shows: the page redraws every second, so
# elements found in one WebDriver call may be gone by the next.
_SNAPSHOT = """
const q = (sel) => [...document.querySelectorAll(sel)];
const text = (id) => document.getElementById(id).textContent;
return {
  peers: q("#peers tbody tr").map((r) => {
    const st = r.querySelector("td.state");
    return {id: r.dataset.peer, stage: r.dataset.stage, state: r.dataset.state, text: r.textContent,
            state_text: st.textContent, state_class: st.className, state_color: getComputedStyle(st).color};
  }),
  points: Number(document.getElementById("loss-chart").dataset.points),
  val: text("val-loss"), val_points: q("#loss-chart .val-point").length, loss: text("loss"),
  bands: q("#plan .stage-band").length, links: q("#links tbody tr").length,
  marks: q("#loss-chart .checkpoint-mark").length,
  epoch: text("epoch"), failures: text("failures"), rollbacks: text("rollbacks"), redone: text("redone"),
  checkpoint: text("checkpoint"), events: q("#events li").map((li) => [li.className, li.textContent]),
  images: q("img").length, title: document.title,
};
"""


def test_page_in_headless_chromium(live: str, recovering: str, tmp_path: Path) -> None:
    browser = _chrome()
    try:
        browser.get(live)
        page = lambda: browser.execute_script(_SNAPSHOT)  # noqa: E731
        _wait(lambda: len(page()["peers"]) == 3, 30, "three peer rows")
        first = page()
        assert sorted(p["stage"] for p in first["peers"]) == ["0", "1", "2"]
        assert all(p["state"] == "serving" for p in first["peers"])
        assert first["points"] >= 1
        _wait(lambda: page()["points"] > first["points"], 30, "the loss chart to gain points")
        assert (first["bands"], first["links"]) == (3, 2)
        resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(url.startswith(live) for url in resources), resources
        shot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        target = os.environ.get("FUSIONLLM_SCREENSHOT")
        if target:
            shutil.copy(shot, target)
        _check_recovery_page(browser, recovering, tmp_path)
    finally:
        browser.quit()


def _check_recovery_page(browser, url: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The epoch, peer states, recovery counters, checkpoint and new event kinds are
    shown, and the hostile device and failure reason appear as text, never as markup."""
    browser.get(url)
    page = lambda: browser.execute_script(_SNAPSHOT)  # noqa: E731
    _wait(lambda: page()["epoch"] == "2", 30, "the epoch")
    st = page()
    peers = {p["id"]: p for p in st["peers"]}
    assert {pid: p["state"] for pid, p in peers.items()} == {
        "a": "serving",
        "b": "lost",
        "c": "serving",
        "d": "serving",
        "e": "joined",
    }
    assert peers["b"]["state_text"] == "lost" and "state-lost" in peers["b"]["state_class"].split()
    assert peers["b"]["state_color"] != peers["a"]["state_color"], "lost and serving look different"
    assert (st["failures"], st["rollbacks"], st["redone"]) == ("1", "1", "2")
    assert st["checkpoint"].startswith("step 4 · 12.0 MB") and st["marks"] == 1
    assert (st["val"], st["val_points"]) == ("5.2500", 1), "the validation loss, and its point on the chart"
    assert st["loss"] == "NaN" and st["points"] == 4, "a NaN loss is said, and left off the chart"
    kinds = [kind for kind, _ in st["events"]]
    for kind in ("join", "epoch", "plan", "links", "checkpoint", "failure", "replace", "rollback"):
        assert kind in kinds, kind
    assert kinds.count("rejected") == MAX_REJECTED_EVENTS
    assert HOSTILE in peers["e"]["text"] and any(HOSTILE in t for kind, t in st["events"] if kind == "failure")
    assert st["images"] == 0 and st["title"] == "FusionLLM swarm"
    shot = tmp_path / "status-page-recovery.png"
    assert browser.save_screenshot(str(shot))
    target = os.environ.get("FUSIONLLM_RECOVERY_SCREENSHOT")
    if target:
        shutil.copy(shot, target)


def test_state_is_strict_json_while_the_loss_is_nan() -> None:
    """A NaN loss (what a poisoned run shows) arrives as the string "NaN": the page's
    JSON parser and ``fusionllm status`` still read the state."""
    now = [1000.0]
    board = _planned_board(now)
    board.step_done(6, float("nan"), 1.0, 100, [(10, 10)])
    board.evaluated(7, float("inf"))

    async def fetch() -> bytes:
        server = StatusServer(board, port=0)
        await server.start()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: urllib.request.urlopen(server.url + "api/v1/state").read())
        finally:
            await server.aclose()

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in the JSON")

    state = json.loads(asyncio.run(fetch()), parse_constant=refuse)
    assert state["training"]["loss"] == "NaN" and state["training"]["val_loss"] == "Infinity"
    assert state["training"]["losses"][-1] == [6, "NaN"]
    text = render_status(state)
    assert "loss NaN" in text and "validation loss Infinity" in text


def test_closing_does_not_wait_for_a_starved_page_process() -> None:
    """The page's process is niced: behind a busy run's peers it may get no CPU for
    seconds, and every run's end waited ``CLOSE_WAIT_S`` (2 s) for it to read the end of
    its input and exit. Closing now ends it at once (here: stopped, as good as starved)."""
    board = _planned_board([1000.0])

    async def stopped_then_closed() -> float:
        server = StatusServer(board, port=0)
        await server.start()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        start = time.monotonic()
        await server.aclose()
        return time.monotonic() - start

    closing = asyncio.run(stopped_then_closed())
    assert closing < CLOSE_WAIT_S / 4, f"closing took {closing:.2f} s"


def test_a_claim_far_above_the_measured_speed_is_flagged() -> None:
    """A peer that advertises far more FLOP/s than its steps show is flagged (rebalancing
    plans it by the measurement); honest overheads (a few times) are not."""
    board = StatusBoard("r", 10)
    board.saw_adverts({"liar": _ad(), "honest": _ad()})
    claim = board.peers["liar"]["flops"]
    board.measured("liar", claim / (CLAIM_SLACK * 4))
    board.measured("honest", claim / 4)
    peers = {p["id"]: p for p in board.state()["peers"]}
    assert peers["liar"]["claim_contradicted"] and not peers["honest"]["claim_contradicted"]
    assert peers["honest"]["measured_flops"] == claim / 4


def test_each_link_shows_its_path_through_nats() -> None:
    """Peers behind NATs: a boundary with one on each side is forwarded, one with a
    NAT'd peer on one side is dialled out, the rest direct."""
    board = StatusBoard("run", steps=10)
    board.saw_adverts({p: _ad() for p in "abcd"})
    board.set_connection("b", "forwarded")
    board.set_connection("c", "forwarded")
    stages = [{"first_op": i, "last_op": i} for i in range(4)]
    board.set_plan([1, 1, 1, 1], stages, [1, 2, 3], [8, 8, 8], [["a"], ["b"], ["c"], ["d"]])
    board.set_links(["none"] * 3, [100.0] * 3)
    st = board.state()
    assert [link["path"] for link in st["links"]] == ["dial-out", "forwarded", "dial-out"]
    connections = {p["id"]: p["connection"] for p in st["peers"]}
    assert connections == {"a": "direct", "b": "forwarded", "c": "forwarded", "d": "direct"}


def test_the_pages_request_budget_reads_a_burst_at_once_then_holds_its_rate() -> None:
    from coordinator.webserve import RequestBudget

    now = [100.0]
    budget = RequestBudget(rate=10.0, burst=20.0, clock=lambda: now[0])
    assert [budget.delay(1) for _ in range(20)] == [0.0] * 20, "the burst is read at once"
    assert abs(budget.delay(1) - 0.1) < 1e-9 and abs(budget.delay(5) - 0.6) < 1e-9, "then at the rate"
    assert not budget.idle()
    assert budget.delay(100, most=5.0) is None and abs(budget.delay(1) - 0.7) < 1e-9, "over the cap: nothing reserved"
    now[0] += 60.0
    assert budget.idle() and budget.delay(20) == 0.0, "an idle minute refills it"


def test_one_clients_flood_takes_its_own_budget_not_the_others() -> None:
    from coordinator import webserve

    now = [0.0]
    budgets = webserve.RequestBudgets(clock=lambda: now[0])
    flooder = budgets.of("10.0.0.1")
    waits = [flooder.delay(100) for _ in range(50)]  # 5,000 requests at once
    assert waits[-1] is not None and waits[-1] > 200, "the flooder waits for its own budget"
    assert budgets.all.delay(1) == 0.0 and budgets.of("10.0.0.2").delay(1) == 0.0, "another client is read at once"


def test_the_page_forgets_refilled_client_budgets_past_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator import webserve

    monkeypatch.setattr(webserve, "MAX_CLIENT_BUDGETS", 4)
    now = [0.0]
    budgets = webserve.RequestBudgets(clock=lambda: now[0])
    for i in range(4):
        budgets.of(f"10.0.0.{i}").delay(1)
    budgets.of("10.0.0.0").delay(500)  # still waiting: kept
    now[0] += 10.0
    budgets.of("10.0.0.9")
    assert sorted(budgets.clients) == ["10.0.0.0", "10.0.0.9"]
