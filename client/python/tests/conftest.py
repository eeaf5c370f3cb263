import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "python"))
BIN = ROOT / os.environ.get("KVTIER_BUILD", "build") / "bin"

from kvtier.daemon import LocalDaemon  # noqa: E402


class Daemon(LocalDaemon):
    def __init__(self, tmp_path: Path, *flags: str):
        super().__init__(BIN / "kvtierd", tmp_path, *flags)


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
    codes = [(d, d.stop()) for d in started]  # every one stopped, before any assert
    for d, code in codes:
        if not getattr(d, "killed", False):  # a test that killed one says so
            assert code == 0, d.log.read_text()


@pytest.fixture
def kvtierctl():
    def run(address, *args):
        return subprocess.run([str(BIN / "kvtierctl"), "--addr", address, *args],
                              capture_output=True, text=True, timeout=30)
    return run
