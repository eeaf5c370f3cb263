"""LocalDaemon: a kvtierd child process on a Unix socket, for tests and the eval harness."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

_counter = itertools.count()


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
        self.proc = subprocess.Popen(
            [str(binary), "--listen", self.address, "--instance", self.instance,
             "--log_level", "warn", *flags],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        for _ in range(200):
            if self.socket.exists() or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not self.socket.exists():
            self.stop()
            raise RuntimeError(f"kvtierd did not start: {self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def __enter__(self) -> "LocalDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
