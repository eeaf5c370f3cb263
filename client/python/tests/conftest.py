import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import BIN, ROOT, free_port

sys.path.insert(0, str(ROOT / "client" / "python"))
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
def pki(tmp_path):
    """In `tmp_path`: a CA (ca.pem), a server certificate for 127.0.0.1 (server.pem, server.key)
    and a client certificate CN=carol, O=team-c (carol.pem, carol.key)."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-days", "1", "-subj", "/CN=kvtier-py-ca",
        "-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.pem"))
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for leaf, subj in (("server", "/CN=localhost"), ("carol", "/O=team-c/CN=carol")):
        run("req", *ec, "-subj", subj, "-keyout", str(tmp_path / f"{leaf}.key"),
            "-out", str(tmp_path / f"{leaf}.csr"))
        run("x509", "-req", "-days", "1", "-in", str(tmp_path / f"{leaf}.csr"),
            "-CA", str(tmp_path / "ca.pem"), "-CAkey", str(tmp_path / "ca.key"),
            "-CAcreateserial", "-extfile", str(tmp_path / "san.ext"),
            "-out", str(tmp_path / f"{leaf}.pem"))
    return tmp_path


@pytest.fixture
def start_tcp_daemon(start_daemon):
    """A factory: a daemon of `start_daemon` also listening on a free TCP port of 127.0.0.1,
    once that port accepts (the Unix socket comes first); the daemon and the port."""
    def start(*flags):
        port = free_port()
        d = start_daemon(*flags, "--tcp_listen", f"127.0.0.1:{port}")
        for _ in range(200):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return d, port
            time.sleep(0.05)
        raise AssertionError(f"kvtierd never listened on 127.0.0.1:{port}: {d.log.read_text()}")
    return start


@pytest.fixture
def kvtierctl():
    def run(address, *args):
        return subprocess.run([str(BIN / "kvtierctl"), "--addr", address, *args],
                              capture_output=True, text=True, timeout=30)
    return run
