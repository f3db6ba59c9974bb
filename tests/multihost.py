"""Several "hosts" on one Linux machine: network namespaces joined by veth pairs to a bridge.

Nothing here knows about hetlb or torch. Each host is a network namespace of its own, with its
loopback up and one interface ``eth0`` carrying its own address; ``eth0`` is one end of a veth pair
whose other end (``p<k>``) is a port of a bridge ``br0`` living in a further namespace (the
"switch"). Nothing is created in the root namespace: no interface, no route, no firewall rule, so
the machine's own networking is untouched and the hosts reach nothing but each other.

    with Cluster(hosts=2) as c:                     # hosts c.hosts[0], c.hosts[1]
        c.cap(1, rate="100mbit")                    # host 1's link: tbf both ways
        server = c.popen(0, [sys.executable, "-m", "http.server", "8000"])  # killed by close()
        get = f"import urllib.request as u; u.urlopen('http://{c.addr(0)}:8000')"
        c.run(1, [sys.executable, "-c", get], timeout=10)
        c.torchrun(["train.py"], nproc_per_node=2, logs="logs", timeout=300)  # an agent per host

Names are unique per run (``hetlb-mh-<pid>-<random>-h<k>`` and ``...-sw``) and so is the /24
(10.x.y.0/24 from the pid and a random number; since the hosts are isolated from the root
namespace, an overlap could not collide with anything anyway). ``close()`` (the context
manager's exit; also registered with ``atexit``, and run on SIGTERM before the process dies of
it) kills every process started in the hosts, then any other process still inside them, and
deletes the namespaces (which removes the veths, the bridge and the qdiscs with them). A run
killed by SIGKILL cannot clean up after itself: the next :class:`Cluster` removes namespaces of
this naming scheme whose creating process is gone (:func:`sweep_stale`; it judges by pid, so
runs in another pid namespace sharing ``/var/run/netns`` would need other names).

A link cap is a ``tbf`` qdisc (token bucket: ``rate``, ``burst``, ``latency``) on the host's ``eth0``
(what the host sends) and on the bridge's port ``p<k>`` (what it receives), so the host's link is
capped in both directions. ``delay=`` adds a ``netem`` delay under it where the kernel has
``sch_netem`` (:func:`netem_available`).

:func:`available` says whether all this can run here (root, ``ip``, ``tc``, a namespace, a veth,
a bridge and a tbf qdisc can be created) and returns the reason when not, for ``pytest.skip``.
"""
from __future__ import annotations

import atexit
import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence, Union

__all__ = ["Cluster", "Host", "available", "netem_available", "sweep_stale", "PREFIX"]

#: Every namespace this module creates is named ``PREFIX-<pid>-<token>-<role>``.
PREFIX = "hetlb-mh"
_NAME = re.compile(rf"^{re.escape(PREFIX)}-(\d+)-([0-9a-f]+)-(h\d+|sw|probe)$")
_IP_TIMEOUT = 15.0


def _ip(*args: str, check: bool = True, timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess:
    """``ip``/``tc`` command (``args[0]`` is the program), output captured, with a timeout."""
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _netns_list() -> List[str]:
    r = _ip("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns`` (only ever one of this module's namespaces)."""
    r = _ip("ip", "netns", "pids", ns, check=False)
    for tok in r.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def _delete_netns(ns: str) -> None:
    _kill_netns_pids(ns)
    _ip("ip", "netns", "del", ns, check=False)


def sweep_stale() -> List[str]:
    """Delete namespaces of this naming scheme whose creating process no longer exists (left by a
    run killed with SIGKILL); returns their names. Namespaces of live runs are left alone."""
    gone = []
    for ns in _netns_list():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete_netns(ns)
            gone.append(ns)
    return gone


_AVAILABLE: Optional[Union[str, bool]] = None
_LIVE: "List[Cluster]" = []
_PREVIOUS_SIGTERM = None


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a CI job's timeout, ``kill``): clean up every live cluster, then die of the signal
    as the previous handler would have (atexit does not run on a signal)."""
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:  # noqa: BLE001 (best effort: the process is going away)
            pass
    prev = _PREVIOUS_SIGTERM
    if callable(prev):
        prev(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL if prev is None else prev)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Once, from the main thread: chain :func:`_on_sigterm` before whatever handled SIGTERM."""
    global _PREVIOUS_SIGTERM
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    _PREVIOUS_SIGTERM = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def available() -> Optional[str]:
    """None where namespaces can be made here, else the reason they cannot (for a skip).

    Probes once per process: root, ``ip`` and ``tc`` on the PATH, then creates a namespace with a
    bridge, a veth pair and a tbf qdisc, and deletes it."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return None if _AVAILABLE is True else str(_AVAILABLE)
    reason: Optional[str] = None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        reason = "needs root (network namespaces: `ip netns add`, veth, tc)"
    elif not shutil.which("ip"):
        reason = "needs the `ip` command (iproute2)"
    elif not shutil.which("tc"):
        reason = "needs the `tc` command (iproute2)"
    else:
        ns = f"{PREFIX}-{os.getpid()}-{random.getrandbits(24):06x}-probe"
        try:
            steps = [("ip", "netns", "add", ns),
                     ("ip", "-n", ns, "link", "add", "br0", "type", "bridge"),
                     ("ip", "-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "b0"),
                     ("ip", "-n", ns, "link", "set", "lo", "up"),
                     ("tc", "-n", ns, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "10mbit",
                      "burst", "64kb", "latency", "50ms")]
            for cmd in steps:
                r = _ip(*cmd, check=False)
                if r.returncode != 0:
                    reason = f"`{' '.join(cmd)}` fails here: {r.stderr.strip() or r.returncode}"
                    break
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = f"network namespaces unusable here: {e}"
        finally:
            _ip("ip", "netns", "del", ns, check=False)
    _AVAILABLE = True if reason is None else reason
    return reason


def netem_available() -> bool:
    """Whether ``tc qdisc ... netem`` works (the kernel may lack ``sch_netem``)."""
    if available() is not None:
        return False
    ns = f"{PREFIX}-{os.getpid()}-{random.getrandbits(24):06x}-probe"
    try:
        _ip("ip", "netns", "add", ns)
        _ip("ip", "-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
        return _ip("tc", "-n", ns, "qdisc", "add", "dev", "a0", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        _ip("ip", "netns", "del", ns, check=False)


class Host:
    """One host: its namespace, address and interface."""

    def __init__(self, index: int, netns: str, addr: str, ifname: str, port: str) -> None:
        self.index, self.netns, self.addr, self.ifname, self.port = index, netns, addr, ifname, port

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.netns!r}, {self.addr})"


class Cluster:
    """``hosts`` network namespaces on one bridge; see the module docstring.

    Args:
        hosts: number of hosts (1 to 200).
        mtu: MTU of every link (veth default 1500).
    """

    ifname = "eth0"

    def __init__(self, hosts: int = 2, mtu: int = 1500) -> None:
        if not 1 <= int(hosts) <= 200:
            raise ValueError(f"hosts must be in 1..200, got {hosts}")
        reason = available()
        if reason is not None:
            raise RuntimeError(f"multihost.Cluster: {reason}")
        sweep_stale()
        token = f"{random.getrandbits(24):06x}"
        base = f"{PREFIX}-{os.getpid()}-{token}"
        pid = os.getpid()
        # 10.x.y.0/24: x in 64..191, y from the random token; not shared with any other run.
        self.subnet = f"10.{64 + (pid % 128)}.{int(token, 16) % 256}"
        self.switch = f"{base}-sw"
        self.hosts: List[Host] = [Host(k, f"{base}-h{k}", f"{self.subnet}.{k + 1}", self.ifname, f"p{k}")
                                  for k in range(int(hosts))]
        self._procs: List[subprocess.Popen] = []
        self._made: List[str] = []
        self._closed = False
        atexit.register(self.close)
        _LIVE.append(self)
        _install_sigterm()
        try:
            self._build(int(mtu))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up

    def _build(self, mtu: int) -> None:
        sw = self.switch
        _ip("ip", "netns", "add", sw)
        self._made.append(sw)
        _ip("ip", "-n", sw, "link", "set", "lo", "up")
        _ip("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("ip", "netns", "add", h.netns)
            self._made.append(h.netns)
            _ip("ip", "-n", h.netns, "link", "set", "lo", "up")
            # Made inside the switch's namespace, one end moved straight into the host's: no name
            # ever appears in the root namespace.
            _ip("ip", "-n", sw, "link", "add", h.port, "mtu", str(mtu), "type", "veth",
                "peer", "name", h.ifname, "mtu", str(mtu), "netns", h.netns)
            _ip("ip", "-n", sw, "link", "set", h.port, "master", "br0")
            _ip("ip", "-n", sw, "link", "set", h.port, "up")
            _ip("ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("ip", "-n", h.netns, "link", "set", h.ifname, "up")
        self.wait_reachable()

    def wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until every host's interface is up with its address usable (not tentative), and
        host 0 reaches every other host (a TCP connect to a closed port answers "refused" once
        the path is there)."""
        deadline = time.monotonic() + timeout
        probe = ("import socket,sys\n"
                 "s=socket.socket(); s.settimeout(0.5)\n"
                 "try:\n s.connect((sys.argv[1], 9)); sys.exit(0)\n"
                 "except ConnectionRefusedError: sys.exit(0)\n"
                 "except OSError: sys.exit(1)\n")
        for h in self.hosts[1:]:
            while True:
                r = self.run(0, [sys.executable, "-c", probe, h.addr], timeout=5, check=False)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"host 0 cannot reach {h} within {timeout} s")
                time.sleep(0.05)

    # ------------------------------------------------------------------ links

    def addr(self, host: int) -> str:
        return self.hosts[host].addr

    def cap(self, host: int, rate: str, burst: Optional[str] = None, latency: str = "100ms",
            delay: Optional[str] = None) -> None:
        """Cap ``host``'s link both ways to ``rate`` (tc syntax: "100mbit", "20mbit", "1gbit")
        with a token bucket (``tbf``); ``burst`` defaults to 2 ms at the rate (at least 16 KiB),
        ``latency`` bounds the queue. ``delay`` ("2ms") adds netem delay (needs sch_netem)."""
        h = self.hosts[host]
        if burst is None:
            burst = f"{max(16 * 1024, int(_rate_bps(rate) / 8 * 0.002))}b"
        if delay is not None and not netem_available():
            raise RuntimeError("delay= needs the netem qdisc (kernel module sch_netem), which this "
                               "kernel lacks")
        for ns, dev in ((h.netns, h.ifname), (self.switch, h.port)):
            _ip("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
                "rate", rate, "burst", burst, "latency", latency)
            if delay is not None:
                _ip("tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:",
                    "netem", "delay", delay)

    def uncap(self, host: int) -> None:
        h = self.hosts[host]
        for ns, dev in ((h.netns, h.ifname), (self.switch, h.port)):
            _ip("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def qdiscs(self, host: int) -> str:
        """``tc qdisc show`` of both ends of ``host``'s link (for logs)."""
        h = self.hosts[host]
        return (_ip("tc", "-n", h.netns, "qdisc", "show", "dev", h.ifname).stdout +
                _ip("tc", "-n", self.switch, "qdisc", "show", "dev", h.port).stdout)

    # ------------------------------------------------------------------ processes

    def command(self, host: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *map(str, argv)]

    def popen(self, host: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (in a session of its own, killed by :meth:`close`);
        ``env`` is added to this process's environment."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        full: Dict[str, str] = dict(os.environ)
        full.update(env or {})
        p = subprocess.Popen(self.command(host, argv), env=full, start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: int, argv: Sequence[str], timeout: float, check: bool = True,
            env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (killed after ``timeout`` seconds)."""
        p = self.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(p)
            raise
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check and r.returncode != 0:
            raise RuntimeError(f"{argv} in {self.hosts[host]} failed ({r.returncode}): {err[-2000:]}")
        return r

    @staticmethod
    def _kill(p: subprocess.Popen, grace: float = 3.0) -> None:
        """SIGTERM the process's session, then SIGKILL it after ``grace`` seconds."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # also what the session left behind (the leader may be gone, its children not)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        for f in (p.stdout, p.stderr, p.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass

    # ------------------------------------------------------------------ torchrun

    def torchrun(self, script: Sequence[str], nproc_per_node: int, logs: str, timeout: float,
                 hosts: Optional[Sequence[int]] = None, port: int = 29400,
                 env: Optional[Mapping[str, str]] = None, python: Optional[str] = None,
                 grace: float = 20.0) -> List[int]:
        """A multi-node torchrun job: one elastic agent per host (all hosts unless ``hosts``),
        inside its namespace, c10d rendezvous at host 0's address (host 0's agent serves the
        store: ``is_host=1``), ``--local-addr`` the host's address (every namespace shares the
        machine's hostname, which would resolve to the root namespace). Each worker gets
        ``GLOO_SOCKET_IFNAME`` (this cluster's interface) and ``MH_HOST`` (its host index).
        ``script`` is the worker command after torchrun's options (script path and arguments).

        Waits for every agent; returns their exit codes. Agent ``k``'s output goes to
        ``logs/agent<k>.log``. If an agent fails, the others get ``grace`` seconds to end on
        their own; past ``timeout`` every agent is killed and ``TimeoutError`` raised with the
        logs' tails. Never leaves a process behind."""
        hosts = list(range(len(self.hosts))) if hosts is None else list(hosts)
        python = python or sys.executable
        os.makedirs(logs, exist_ok=True)
        rdzv_id = f"mh{os.getpid()}{random.getrandbits(24):06x}"
        procs = []
        files = []
        try:
            for k in hosts:
                h = self.hosts[k]
                cmd = [python, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
                       f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint={self.addr(hosts[0])}:{port}", f"--rdzv-id={rdzv_id}",
                       f"--rdzv-conf=is_host={1 if k == hosts[0] else 0},join_timeout={int(timeout)}",
                       f"--local-addr={h.addr}", "--max-restarts=0", "--monitor-interval=0.2",
                       *map(str, script)]
                f = open(os.path.join(logs, f"agent{k}.log"), "w")
                files.append(f)
                e = {"GLOO_SOCKET_IFNAME": h.ifname, "MH_HOST": str(k), "PYTHONUNBUFFERED": "1",
                     "OMP_NUM_THREADS": "1", **(env or {})}
                procs.append(self.popen(k, cmd, env=e, stdout=f, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            failed_at = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    return codes
                now = time.monotonic()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now
                if now > deadline or (failed_at is not None and now - failed_at > grace):
                    for p in procs:
                        self._kill(p)
                    if now > deadline:
                        raise TimeoutError(f"torchrun job not done in {timeout} s\n"
                                           + self._tails(logs, hosts))
                    return [p.returncode for p in procs]
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    self._kill(p)
            for f in files:
                f.close()

    @staticmethod
    def _tails(logs: str, hosts: Sequence[int], chars: int = 3000) -> str:
        out = []
        for k in hosts:
            try:
                with open(os.path.join(logs, f"agent{k}.log")) as f:
                    out.append(f"--- agent{k}.log ---\n{f.read()[-chars:]}")
            except OSError:
                pass
        return "\n".join(out)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill every process started here (and anything else inside the hosts), delete the
        namespaces. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        try:
            for p in self._procs:
                self._kill(p)
        finally:
            for ns in reversed(self._made):
                _delete_netns(ns)
            atexit.unregister(self.close)
            if self in _LIVE:
                _LIVE.remove(self)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rate_bps(rate: str) -> float:
    """Bits per second of a tc rate ("100mbit", "1gbit", "500kbit", "12.5mbps" = bytes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. '100mbit')")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value * (8 if m.group(3) == "bps" else 1)
