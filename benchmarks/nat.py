"""Across NATs: how fast tensors move, and a swarm trains, when peers sit behind
home routers (issue 15), on the namespaces of ``tests/netlab.py`` (Linux, root,
iproute2 and nftables), every public link shaped by ``tbf`` to the same rate.

- ``direct_mb_per_s``: a public peer sends 64 MiB of signed frames to a peer that
  anyone can dial (a router's own public address), over one shaped link;
- ``dialout_mb_per_s``: the same, to a peer behind that router's NAT, over the
  connection that peer dialled out (the same link, through the NAT);
- ``forwarded_mb_per_s``: from a peer behind one NAT to a peer behind another,
  through a forwarder on the public side (two shaped links, store and forward);
- ``swarm_nat_vs_direct_tokens``: tokens/s of a two-stage swarm whose peers sit
  behind the two NATs (their boundary forwarded) over the same swarm with its
  peers on the routers' public addresses.

Each ratio is measured side by side in one run. Prints one JSON object; on a machine
that cannot build the lab, ``{"skipped": why}``. ``--short``: 16 MiB transfers, fewer steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

FRAME_BYTES = 4 << 20  # under the lane threshold: every path carries whole frames on one stream
LINK_MBIT = 400


# ---------------------------------------------------------------- a node inside a namespace
async def _node(listen_ip: str, bootstrap: str) -> None:
    """One transport in this namespace, driven by JSON lines on stdin (``_Node``)."""
    import torch

    from protocol.net.dhtstart import start_dht
    from protocol.net.transport import Transport
    from protocol.trust.identity import Identity, public_key
    from protocol.wire.gate import Gate
    from protocol.wire.messages import Activations

    dht = start_dht(host_maddrs=[f"/ip4/{listen_ip}/tcp/0"], initial_peers=[bootstrap] if bootstrap else [])
    ident = Identity.generate()
    tp = Transport(await dht.replicate_p2p(), ident, Gate("bench", 1 << 30))
    await tp.start()
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    print(json.dumps({"id": tp.peer_id, "key": ident.public_hex, "maddrs": maddrs}), flush=True)
    acks: asyncio.Queue[None] = asyncio.Queue()

    async def sink() -> None:
        while True:
            inbound = await tp.inbox.get()
            msg = inbound.message
            if msg.step == 1:  # an ack
                acks.put_nowait(None)
            elif msg.mb == msg.stage:  # the last frame of a transfer (stage carries the count - 1)
                await tp.send(inbound.sender, Activations("bench", 1, 0, 0), [torch.zeros(1)])

    task = asyncio.create_task(sink())
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        for pid, info in cmd.get("admit", {}).items():
            tp.gate.admit(pid, public_key(info["key"]))
            tp.learn(pid, info["maddrs"])
        tp.forward_via.update(cmd.get("via", {}))
        tp.forwarder.forwarders.update(cmd.get("via", {}).values())
        tp.dials_in.update(cmd.get("dials_in", []))
        if cmd.get("relay"):
            tp.forwarder.relay_ok = lambda origin, dest, nbytes: True
        answer: dict[str, Any] = {"ok": True}  # every command is answered once it took effect
        if cmd.get("dial"):
            answer = {"dialled": not await tp.dial_out(cmd["dial"])}
        if "send" in cmd:
            to, frames = cmd["send"], cmd["frames"]
            x = torch.zeros(FRAME_BYTES // 4)
            t0 = time.perf_counter()
            for i in range(frames):
                await tp.send(to, Activations("bench", 0, i, frames - 1), [x])
            await asyncio.wait_for(acks.get(), 300)
            answer = {"mb_per_s": frames * FRAME_BYTES / (time.perf_counter() - t0) / 1e6}
        print(json.dumps(answer), flush=True)
    task.cancel()
    await tp.aclose()
    dht.shutdown()


class _Node:
    """A ``_node`` process in a namespace."""

    def __init__(self, prefix: list[str], ip: str, bootstrap: str = "") -> None:
        self.log = tempfile.TemporaryFile()  # what it said, shown if it fails
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, __file__, "--node", ip, bootstrap],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        self.info = self.read()

    def read(self, timeout: float = 330.0) -> dict[str, Any]:  # beyond a node's own 300 s wait: its error shows
        """The node's next answer (a hung node is an error, not a hung benchmark)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            fd = self.log.fileno()  # read where it is, not from the offset the node shares and writes at
            said = os.pread(fd, 3000, max(0, os.fstat(fd).st_size - 3000)).decode(errors="replace")
            raise RuntimeError(f"a benchmark node gave no answer within {timeout:.0f} s (or exited):\n{said}")
        return json.loads(line)

    def tell(self, **cmd: Any) -> dict[str, Any]:
        """Send a command and wait for its answer: a setting has taken effect before
        the next command goes to any node (a frame forwarded to a node not yet told
        of its forwarder would be refused)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self.read()
        if answer.get("dialled") is False:
            raise RuntimeError(f"a benchmark node could not dial out to {cmd['dial']}")
        return answer

    def close(self) -> None:
        try:  # its own session: the node and its p2p daemon go together
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()


def _introduce(*nodes: _Node) -> None:
    for n in nodes:
        n.tell(admit={m.info["id"]: m.info for m in nodes if m is not n})


def _transfers(lab: Any, frames: int) -> dict[str, float]:
    """MB/s of the three paths (see the module)."""
    from netlab import PUBLIC_IP

    nodes: list[_Node] = []
    try:
        pub = _Node(lab.prefix(lab.pub), PUBLIC_IP)
        nodes.append(pub)
        boot = pub.info["maddrs"][0]
        edge = _Node(lab.prefix(lab.routers[0]), lab.router_ip(1), boot)  # dialable: the router's own address
        h1 = _Node(lab.prefix(lab.hosts[0]), lab.host_ip(1), boot)
        h2 = _Node(lab.prefix(lab.hosts[1]), lab.host_ip(2), boot)
        nodes += [edge, h1, h2]
        _introduce(*nodes)
        out = {}
        out["direct_mb_per_s"] = pub.tell(send=edge.info["id"], frames=frames)["mb_per_s"]
        h1.tell(dial=[pub.info["id"]])
        out["dialout_mb_per_s"] = pub.tell(dials_in=[h1.info["id"]], send=h1.info["id"], frames=frames)["mb_per_s"]
        h2.tell(dial=[pub.info["id"]])
        pub.tell(relay=True)
        h1.tell(via={h2.info["id"]: pub.info["id"]})
        sent = h2.tell(via={h1.info["id"]: pub.info["id"]}, send=h1.info["id"], frames=frames)
        out["forwarded_mb_per_s"] = sent["mb_per_s"]
        return out
    finally:
        for n in nodes:
            n.close()


def _swarm_tokens(lab: Any, natted: bool, steps: int, tmp: Path) -> float:
    """Tokens/s of a two-stage swarm: peers behind the two NATs, or on the routers."""
    from netlab import PUBLIC_IP
    from swarmproc import SMALL, Proc, summary_tokens_per_s

    where = [(lab.hosts[r], lab.host_ip(r + 1)) if natted else (lab.routers[r], lab.router_ip(r + 1)) for r in (0, 1)]
    procs: list[Proc] = []
    try:
        stage_args = ["--steps", str(steps), "--seed", "0", *SMALL, "--min-peers", "2", "--stages", "2"]
        key = str(tmp / f"c{natted}.key")
        net_args = ["--host-maddrs", f"/ip4/{PUBLIC_IP}/tcp/0", "--identity", key, "--status-port", "0"]
        run_args = ["--compression", "none", "--spot-check", "0", "--run-dir", str(tmp / f"run{natted}")]
        coord = Proc("coordinator", *stage_args, *net_args, *run_args, netns=lab.pub)
        procs.append(coord)
        join = coord.wait_line(r"^\s+fusionllm join (.*)$").group(1).split()
        for i, (ns, ip) in enumerate(where):
            peer_args = ["--identity", str(tmp / f"p{i}{natted}.key"), "--host-maddrs", f"/ip4/{ip}/tcp/0"]
            procs.append(Proc("join", *join, "--threads", "1", *peer_args, netns=ns))
        if coord.wait(600) != 0:
            raise RuntimeError(f"the swarm failed:\n{coord.output[-2000:]}")
        found = summary_tokens_per_s(coord.output)
        if found is None:
            raise RuntimeError(f"no tokens/s in the swarm's output:\n{coord.output[-2000:]}")
        return found
    finally:
        for p in procs:
            p.kill_all()


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--node", nargs=2, metavar=("IP", "BOOTSTRAP"))
    args = parser.parse_args()
    from fusionllm.reaper import start_reaper

    start_reaper()  # killed, its children go too (a node's: its DHT and p2pd)
    if args.node:
        asyncio.run(_node(*args.node))
        return
    from netlab import NatLab, missing

    why = missing()
    if why:
        print(json.dumps({"skipped": why, "short": args.short}))
        return
    frames, steps = (4, 30) if args.short else (16, 150)
    signal.signal(signal.SIGTERM, _terminate)  # unwinds: the lab's namespaces go with the processes
    lab = NatLab(routers=2, mbps=LINK_MBIT)
    try:
        out: dict[str, Any] = _transfers(lab, frames)
        with tempfile.TemporaryDirectory() as tmp:
            direct = _swarm_tokens(lab, False, steps, Path(tmp))
            natted = _swarm_tokens(lab, True, steps, Path(tmp))
    finally:
        lab.close()
    out["dialout_vs_direct"] = round(out["dialout_mb_per_s"] / out["direct_mb_per_s"], 3)
    out["forwarded_vs_direct"] = round(out["forwarded_mb_per_s"] / out["direct_mb_per_s"], 3)
    out["swarm_nat_vs_direct_tokens"] = round(natted / direct, 3)
    out.update({k: round(v, 1) for k, v in out.items() if k.endswith("_mb_per_s")})
    out.update(link_mbit=LINK_MBIT, swarm_tokens_per_s_direct=direct, swarm_tokens_per_s_nat=natted, short=args.short)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
