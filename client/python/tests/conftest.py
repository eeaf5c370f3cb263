import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "python"))
BIN = ROOT / os.environ.get("KVTIER_BUILD", "build") / "bin"
_counter = itertools.count()


class Daemon:
    def __init__(self, tmp_path: Path, *flags: str):
        self.socket = tmp_path / "kvtier.sock"
        self.instance = f"py-{os.getpid()}-{next(_counter)}"
        self.address = f"unix:{self.socket}"
        self.log = tmp_path / "daemon.log"
        self.proc = subprocess.Popen(
            [str(BIN / "kvtierd"), "--listen", self.address, "--instance", self.instance,
             "--log_level", "warn", *flags],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        for _ in range(200):
            if self.socket.exists() or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not self.socket.exists():
            raise RuntimeError(f"kvtierd did not start: {self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture
def start_daemon(tmp_path):
    """A factory for daemons with extra flags; each is stopped after the test."""
    started = []

    def start(*flags):
        d = Daemon(tmp_path / f"d{len(started)}", *flags)
        started.append(d)
        return d

    (tmp_path / "d0").mkdir()
    for i in range(1, 4):
        (tmp_path / f"d{i}").mkdir()
    yield start
    for d in started:
        assert d.stop() == 0, d.log.read_text()


@pytest.fixture
def kvtierctl():
    def run(address, *args):
        return subprocess.run([str(BIN / "kvtierctl"), "--addr", address, *args],
                              capture_output=True, text=True, timeout=30)
    return run
