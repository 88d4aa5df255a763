"""A misbehaving link for ranks on one machine: a network namespace of our
own whose loopback loses packets. Everything the ranks send each other (MPI
over TCP, Gloo, the TCPStore) crosses that loopback.

Impairments, the kernel's netem when it has it (1% loss, 2 ms +- 1 ms
jitter, 5% of packets reordered). Without netem (this project's machines):
nftables drops a random 1% on input, and for jitter and reordering marks a
random eighth of the packets on output (DSCP CS1), which an htb class of
their own (u32 on the TOS byte) holds to 100 Mbit/s while the rest pass at
1 Gbit/s: the held packets wait a varying time in their queue and arrive
after packets sent later. `impairment` says which ran; `tcp_counters()`
reads the namespace's TCP counters (out-of-order, retransmits), so a test
can show the link really misbehaved. `cut()` drops everything (100% loss),
`heal()` restores a clean link.

    with LossyLink() as link:          # pytest.skip()s where namespaces cannot be made
        link.impair()
        subprocess.run(link.prefix + ["mpirun", ...])
"""
import os
import shutil
import subprocess

import pytest

NETEM = ["netem", "loss", "1%", "delay", "2ms", "1ms", "reorder", "5%", "50%"]


def _sh(*cmd, check=True):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=check)


class LossyLink:
    def __init__(self):
        self.ns = f"ddpx-lossy-{os.getpid()}"
        self.prefix = ["ip", "netns", "exec", self.ns]
        self.impairment = "clean"
        self.made = False

    def __enter__(self):
        try:
            _sh("ip", "netns", "add", self.ns)
            self.made = True
            _sh("ip", "-n", self.ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            self.close()
            pytest.skip(f"cannot create a network namespace here: {getattr(e, 'stderr', e)}")
        self.netem = _sh(*self.prefix, "tc", "qdisc", "add", "dev", "lo", "root", *NETEM,
                         check=False).returncode == 0
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "del", "dev", "lo", "root")
        elif not shutil.which("nft") or _sh(*self.prefix, "nft", "add", "table", "inet", "ddpx",
                                            check=False).returncode != 0:
            self.close()
            pytest.skip("this kernel has neither netem nor nftables: no lossy link")
        return self

    def _nft(self, per_mille, reorder=False):
        """Drops `per_mille` of 1000 packets arriving over the loopback, on
        input, not output: a packet dropped on output is an EPERM to its
        sender (a refused connect), not a loss TCP recovers from. With
        `reorder`, marks a random eighth of the packets on output for the
        slow htb class (see the module's text)."""
        _sh(*self.prefix, "nft", "flush", "ruleset")
        rules = []
        if per_mille > 0:
            rule = "drop" if per_mille >= 1000 else f"numgen random mod 1000 < {per_mille} drop"
            rules.append("add chain inet ddpx in { type filter hook input priority 0; policy accept; }; "
                         f"add rule inet ddpx in {rule}")
        if reorder:
            rules.append("add chain inet ddpx out { type filter hook output priority 0; policy accept; }; "
                         "add rule inet ddpx out meta mark set numgen random mod 8; "
                         "add rule inet ddpx out meta mark 1 ip dscp set cs1")
        if rules:
            _sh(*self.prefix, "nft", "add table inet ddpx; " + "; ".join(rules))

    def _slow_lane(self, on):
        """An htb qdisc on the loopback: packets marked CS1 (TOS 0x20) take a
        100 Mbit/s class, the rest a 1 Gbit/s one."""
        tc = [*self.prefix, "tc"]
        _sh(*tc, "qdisc", "del", "dev", "lo", "root", check=False)
        if not on:
            return
        _sh(*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
        _sh(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "1gbit",
            "burst", "256kb")
        _sh(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", "100mbit",
            "ceil", "100mbit", "burst", "8kb")
        _sh(*tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "tos", "0x20", "0xfc", "flowid", "1:20")

    def tcp_counters(self):
        """The namespace's TCP counters (nstat names without the prefix):
        TCPOFOQueue (segments that arrived out of order), RetransSegs, ..."""
        out = _sh(*self.prefix, "nstat", "-az", check=False).stdout
        counters = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                counters[parts[0].removeprefix("TcpExt").removeprefix("Tcp")] = int(parts[1])
        return counters

    def impair(self):
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "replace", "dev", "lo", "root", *NETEM)
            self.impairment = "netem " + " ".join(NETEM[1:])
        else:
            self._nft(10, reorder=True)
            self._slow_lane(True)
            self.impairment = ("nftables + htb: 1% random drop, a random eighth of the packets "
                               "held in a 100 Mbit/s lane (jitter, reordering)")

    def cut(self):
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "replace", "dev", "lo", "root", "netem", "loss", "100%")
        else:
            self._slow_lane(False)
            self._nft(1000)
        self.impairment = "cut (100% loss)"

    def heal(self):
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        else:
            self._slow_lane(False)
            self._nft(0)
        self.impairment = "clean"

    def close(self):
        if self.made:
            _sh("ip", "netns", "del", self.ns, check=False)
            self.made = False

    def __exit__(self, *exc):
        self.close()
