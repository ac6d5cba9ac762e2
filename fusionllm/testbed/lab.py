"""Network namespaces for the testbed (Linux, root, iproute2): a hub namespace holding
a bridge, the coordinator's namespace and one per peer, each joined to the bridge by a
veth. On each peer's side an ``htb`` qdisc has one class per other peer, at the pair's
rate, chosen by a ``u32`` filter on the destination address (kernel shaping of every
ordered pair); traffic to the coordinator goes unshaped. Latency is not the kernel's
(no netem here): the processes add it in their send path (``protocol.net.delay``).

Names carry a tag (this process's id modulo 100000): ``run`` first removes what a lab
whose process is gone left behind (``remove_stale``), ``down`` removes every testbed
namespace whatever its tag; deleting a namespace deletes its veths and qdiscs."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable

logger = logging.getLogger(__name__)
PREFIX = "fltb"  # every testbed namespace's name starts so
_NAME = re.compile(rf"{PREFIX}(\d+)(?:hub|c|h\d+)")
#: traffic that matches no destination's filter (the coordinator's): as fast as the veth goes
UNSHAPED = "10gbit"
#: within a pair's rate, packets under 256 bytes (an IP total length whose
#: high byte is 0) go before the bulk, as a router with smart queue management lets
#: them. Without it, one FIFO per direction made a transfer that ran against another
#: the other way wait for its acknowledgements behind that one's data: 0.56 MB each
#: way at 10 Mbit/s took 433 ms alone and 750 ms against one (a home uplink without
#: smart queueing does that; the estimator does not model it)
SMALL_FIRST = ["match", "u16", "0x0000", "0xff00", "at", "2"]
#: the rate the small packets are sure of (they borrow the rest of the pair's)
SMALL_SHARE = 0.05
#: a pair's bucket: what it may send at once after an idle spell, 1 ms at its rate and
#: at least two frames. A real link sends nothing early; with 10 ms and at least 16 kB,
#: a 67.6 kB micro-batch took 84 ms at 5 Mbit/s where the link's rate gives 108, and
#: the estimator put dtfm's plan on far-lab 11-12% over its measured step
BURST_S = 1e-3
MIN_BURST_BYTES = 3000
#: the largest packet the peers' stacks hand the qdisc (``gso_max_size``): one frame, so
#: that the bucket counts frames; with 64 kB segments a small bucket let bursts through
MAX_SEGMENT_BYTES = 1500


def missing(tools: Iterable[str] = ("ip", "tc")) -> str:
    """Why this machine cannot build namespaces ('' if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install iproute2 nftables)"
    probe = f"flprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def run(*args: str, stdin: str | None = None) -> None:
    """Run one command; RuntimeError with its stderr when it fails."""
    r = subprocess.run(list(args), input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


def alive(pid_tag: int) -> bool:
    """Whether a process whose pid ends like this tag (pid % 100000) still runs."""
    return any(pid % 100000 == pid_tag for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()))


def namespaces() -> list[str]:
    """Every namespace on this machine."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete testbed namespaces whose process is gone (killed before it cleaned up)."""
    gone = [n for n in namespaces() if (m := _NAME.fullmatch(n)) and not alive(int(m.group(1)))]
    for name in gone:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return gone


def down() -> list[str]:
    """Delete every testbed namespace (and with them their veths and qdiscs)."""
    ours = [n for n in namespaces() if _NAME.fullmatch(n)]
    for name in ours:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ours


class Lab:
    """The namespaces of one testbed: ``hosts`` maps a host's name to its address (the
    coordinator's included); ``rates`` gives Mbit/s per ordered pair of host names.
    The constructor does nothing; ``build`` makes everything (and removes what it made
    when it fails halfway); ``close`` removes it all."""

    def __init__(self, hosts: dict[str, str], rates: dict[tuple[str, str], float], tag: int | None = None) -> None:
        self.tag = os.getpid() % 100000 if tag is None else tag
        self.hosts = dict(hosts)
        self.rates = dict(rates)
        self.hub = f"{PREFIX}{self.tag}hub"
        self.ns = {h: f"{PREFIX}{self.tag}{'c' if i == 0 else f'h{i}'}" for i, h in enumerate(self.hosts)}
        self.made: list[str] = []

    def build(self) -> None:
        try:
            self._make(self.hub)
            run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, (host, ip) in enumerate(self.hosts.items()):
                self._make(self.ns[host])
                self._attach(self.ns[host], ip, f"v{i}")
                self._shape(host)
        except BaseException:
            self.close()
            raise

    def _make(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self.made.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def _attach(self, ns: str, ip: str, port: str) -> None:
        run("ip", "link", "add", "fltbtmp", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
        run("ip", "-n", ns, "link", "set", "fltbtmp", "name", "eth0")
        run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        run("ip", "-n", self.hub, "link", "set", port, "up")

    def _shape(self, host: str) -> None:
        """An htb class per destination on ``host``'s side of its veth, at the pair's
        rate; within it, packets under 256 bytes (TCP's acknowledgements, small
        messages) go first (``SMALL_FIRST``), each child with the pair's burst."""
        shaped = [(dst, mbps) for (src, dst), mbps in self.rates.items() if src == host]
        if not shaped:
            return
        try:  # a kernel that cannot change it on a live veth keeps 64 kB segments (a bucket's worth early)
            run("ip", "-n", self.ns[host], "link", "set", "dev", "eth0", "gso_max_size", str(MAX_SEGMENT_BYTES))
        except RuntimeError as exc:
            logger.warning("testbed: %s", exc)
        tc = ["tc", "-n", self.ns[host]]
        run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", UNSHAPED)
        for n, (dst, mbps) in enumerate(shaped, start=10):
            burst = f"{max(int(mbps * 1e6 / 8 * BURST_S), MIN_BURST_BYTES)}b"
            pair = ["htb", "rate", f"{mbps:g}mbit", "burst", burst, "cburst", burst]
            run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{n}", *pair)
            to = ["match", "ip", "dst", f"{self.hosts[dst]}/32"]
            kinds = ((f"a{n}", SMALL_SHARE, SMALL_FIRST), (f"b{n}", 1 - SMALL_SHARE, []))
            for prio, (child, share, match) in enumerate(kinds):
                rates = ["rate", f"{mbps * share:g}mbit", "ceil", f"{mbps:g}mbit", "prio", str(prio), *pair[3:]]
                run(*tc, "class", "add", "dev", "eth0", "parent", f"1:{n}", "classid", f"1:{child}", "htb", *rates)
                flt = ["parent", "1:", "protocol", "ip", "prio", str(prio + 1), "u32", *to, *match]
                run(*tc, "filter", "add", "dev", "eth0", *flt, "flowid", f"1:{child}")

    def close(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this lab still present (none after ``close``)."""
        present = set(namespaces())
        return [n for n in [self.hub, *self.ns.values()] if n in present]
