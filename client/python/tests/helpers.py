"""Small helpers the tests share (import them; pytest puts this folder on sys.path)."""
import socket


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
