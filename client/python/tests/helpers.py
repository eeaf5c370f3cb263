"""Small helpers the tests share (import them; pytest puts this folder on sys.path)."""
import os
import socket
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BIN = ROOT / os.environ.get("KVTIER_BUILD", "build") / "bin"  # the built binaries


def free_port():
    """A TCP port of 127.0.0.1 free at this moment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    """Process `pid`'s resident memory, KiB (/proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def counter(port, name):
    """The value of an unlabelled metric on the daemon whose --metrics_port is `port`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")
