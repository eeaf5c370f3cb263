"""LocalDaemon: a kvtierd child process on a Unix socket, for tests and the eval harness."""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

_counter = itertools.count()


def _accepts(path: Path) -> bool:
    """Whether a server listens on the Unix socket `path`: its socket file appears a moment
    before it listens, and a connection in between is refused."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


class LocalDaemon:
    """Starts `binary` listening on `directory`/kvtier.sock; `stop()` sends SIGTERM and
    returns the exit status. The log is `directory`/daemon.log."""

    def __init__(self, binary: str | os.PathLike, directory: str | os.PathLike, *flags: str,
                 prefix: str = "py"):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.socket = directory / "kvtier.sock"
        self.instance = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.address = f"unix:{self.socket}"
        self.log = directory / "daemon.log"
        with self.log.open("w") as log:  # the child holds its own descriptor of it
            self.proc = subprocess.Popen(
                [str(binary), "--listen", self.address, "--instance", self.instance,
                 "--log_level", "warn", *flags],
                stdout=log, stderr=subprocess.STDOUT)
        started = False
        # up to a minute: a loaded machine (sanitizers, fuzzers beside it) starts slowly
        for _ in range(1200):
            started = _accepts(self.socket)
            if started or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not started:
            self.stop()
            raise RuntimeError(f"kvtierd did not start: {self.log.read_text()}")

    def stop(self) -> int:
        """SIGTERM (unless it has exited already); its exit status, waited for up to 30 s,
        after which it is killed (SIGKILL) and that status given."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "LocalDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
