"""A misbehaving link for ranks on one machine: a network namespace of our
own whose loopback loses packets. Everything the ranks send each other (MPI
over TCP, Gloo, the TCPStore) crosses that loopback.

Impairments, the kernel's netem when it has it (1% loss, 2 ms +- 1 ms
jitter, 5% of packets reordered), else nftables dropping a random 1% (no
jitter or reordering then: `impairment` says which ran). `cut()` drops
everything (100% loss), `heal()` restores a clean link.

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

    def _drop(self, per_mille):
        """Drops `per_mille` of 1000 packets arriving over the loopback
        (nftables). On input, not output: a packet dropped on output is an
        EPERM to its sender (a refused connect), not a loss TCP recovers from."""
        _sh(*self.prefix, "nft", "flush", "ruleset")
        if per_mille == 0:
            return
        rule = "drop" if per_mille >= 1000 else f"numgen random mod 1000 < {per_mille} drop"
        _sh(*self.prefix, "nft", f"add table inet ddpx; add chain inet ddpx in "
            f"{{ type filter hook input priority 0; policy accept; }}; add rule inet ddpx in {rule}")

    def impair(self):
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "replace", "dev", "lo", "root", *NETEM)
            self.impairment = "netem " + " ".join(NETEM[1:])
        else:
            self._drop(10)
            self.impairment = "nftables: 1% random drop (this kernel has no netem: no jitter, no reordering)"

    def cut(self):
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "replace", "dev", "lo", "root", "netem", "loss", "100%")
        else:
            self._drop(1000)
        self.impairment = "cut (100% loss)"

    def heal(self):
        if self.netem:
            _sh(*self.prefix, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        else:
            self._drop(0)
        self.impairment = "clean"

    def close(self):
        if self.made:
            _sh("ip", "netns", "del", self.ns, check=False)
            self.made = False

    def __exit__(self, *exc):
        self.close()
