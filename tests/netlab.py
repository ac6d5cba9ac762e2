"""A small internet in network namespaces (Linux, root): a public side, and home
routers doing source NAT (nftables masquerade) with one host behind each.

::

    pub  (10.77.0.1 on its loopback; 10.77.R.1 towards router R)
     |-- veth, tbf-shaped in both directions -- rR (10.77.R.2 | 192.168.R.1) -- hR (192.168.R.2)

The public namespace routes only to the routers' public addresses, never to the
private nets behind them, and each router forwards only what its host started
(``ct state established,related``): a host behind a router can dial out, and no
one can dial in. Everything is removed on ``close`` (deleting a namespace deletes
its veths, routes and nftables rules), also when setting up fails halfway."""

from __future__ import annotations

import os
import re
import subprocess

from fusionllm.testbed import lab
from fusionllm.testbed.lab import run as _run

#: the public address of the public side (the coordinator and direct peers listen there)
PUBLIC_IP = "10.77.0.1"


def missing() -> str:
    """Why this machine cannot build the lab ('' if it can)."""
    return lab.missing(("ip", "nft", "tc"))


class NatLab:
    """``routers`` home routers, each with one host behind it; public links of
    ``mbps`` Mbit/s (0: unshaped)."""

    def __init__(self, routers: int = 2, mbps: float = 0.0) -> None:
        _remove_stale()
        tag = f"{os.getpid() % 100000}"
        self.pub = f"flpub{tag}"
        self.routers = [f"flr{r}x{tag}" for r in range(1, routers + 1)]
        self.hosts = [f"flh{r}x{tag}" for r in range(1, routers + 1)]
        self.mbps = mbps
        self.made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def host_ip(self, r: int) -> str:
        """The private address of the host behind router ``r`` (1-based)."""
        return f"192.168.{r}.2"

    def router_ip(self, r: int) -> str:
        """Router ``r``'s public address: what the public side sees of its host."""
        return f"10.77.{r}.2"

    def prefix(self, ns: str) -> list[str]:
        """The command prefix that runs a process in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def _ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._ns(self.pub)
        _run("ip", "-n", self.pub, "addr", "add", f"{PUBLIC_IP}/32", "dev", "lo")
        _run("ip", "netns", "exec", self.pub, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # between the routers
        for r, (router, host) in enumerate(zip(self.routers, self.hosts, strict=True), start=1):
            self._ns(router)
            self._ns(host)
            self._link(self.pub, f"tor{r}", f"10.77.{r}.1/24", router, "wan", f"10.77.{r}.2/24")
            self._link(router, "lan", f"192.168.{r}.1/24", host, "eth0", f"192.168.{r}.2/24")
            _run("ip", "-n", router, "route", "add", "default", "via", f"10.77.{r}.1")
            _run("ip", "-n", host, "route", "add", "default", "via", f"192.168.{r}.1")
            _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "netns", "exec", router, "nft", "-f", "-", stdin=_NAT_RULES)
            if self.mbps:
                tbf = ["root", "tbf", "rate", f"{self.mbps}mbit", "burst", "256kb", "latency", "50ms"]
                for ns, dev in ((self.pub, f"tor{r}"), (router, "wan")):
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, *tbf)

    def _link(self, ns_a: str, dev_a: str, ip_a: str, ns_b: str, dev_b: str, ip_b: str) -> None:
        _run("ip", "link", "add", "fltmp0", "netns", ns_a, "type", "veth", "peer", "name", "fltmp1", "netns", ns_b)
        for ns, old, dev, ip in ((ns_a, "fltmp0", dev_a, ip_a), (ns_b, "fltmp1", dev_b, ip_b)):
            _run("ip", "-n", ns, "link", "set", old, "name", dev)
            _run("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")

    def close(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this lab still present (none after ``close``)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return [n for n in [self.pub, *self.routers, *self.hosts] if n in listed]


def _remove_stale() -> None:
    """Namespaces of labs whose process is gone (killed before it could clean up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        found = re.fullmatch(r"fl(?:pub|r\d+x|h\d+x)(\d+)", name)
        if found and not lab.alive(int(found.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


#: source NAT for what leaves by the WAN side; only replies (and what the LAN side
#: starts) are forwarded: nothing from outside can open a connection inward
_NAT_RULES = """
table ip flnat {
  chain postnat { type nat hook postrouting priority srcnat; oifname "wan" masquerade; }
  chain inward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan" accept
  }
}
"""
