"""The RPC transport against callers that hold memory: a caller that sends large messages and
stops short of their last byte makes gRPC hold each one until the call ends, before any of
kvtier's own checks run. A raw HTTP/2 client (this file's, a few frames by hand: gRPC's own
clients always finish a message they start) does that on many streams at once, and the
daemon's resident memory is read meanwhile from /proc. The bound (--max_rpc_buffer_size) keeps
it near its size; over TLS a call without credentials ends at its headers, before its message
is read at all. Connections themselves are bounded per uid (--max_connections_per_uid)."""
import hashlib
import os
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
import time

import grpc
import pytest

import kvtier
from helpers import BIN, counter, free_port, rss_kib
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
ENHANCE_YOUR_CALM = 11  # the HTTP/2 error gRPC resets a stream with when its buffers are full
SETTINGS_INITIAL_WINDOW_SIZE = 4


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) \
        + payload


def header(name, value):
    """An HPACK literal header field, not indexed, its strings plain (RFC 7541 6.2.2)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class HalfSender:
    """One connection (`sock`, connected) whose `streams` Echo calls each declare a gRPC message
    of `size` bytes and send all of it but the last byte, as the flow-control windows the daemon
    grants allow; then it only answers the daemon's SETTINGS and PINGs. `token`: each call's
    bearer token."""

    def __init__(self, sock, streams, size, token=None):
        self.sock = sock
        self.sock.setblocking(False)
        self.inbox = b""
        self.out = bytearray(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0))
        self.connection_window = self.initial_window = 65535
        # stream id -> [bytes left to send, its window or None until first used]
        self.left = {}
        self.window = {}
        self.resets = []  # the error codes of the streams the daemon reset
        self.answered = 0  # streams the daemon ended with its reply's headers alone
        self.closed = False
        fields = (header(b":method", b"POST") + header(b":scheme", b"http") +
                  header(b":path", b"/kvtier.v1.KvTier/Echo") +
                  header(b":authority", b"localhost") +
                  header(b"content-type", b"application/grpc") + header(b"te", b"trailers"))
        if token is not None:
            fields += header(b"authorization", b"Bearer " + token.encode())
        for i in range(streams):
            sid = 2 * i + 1
            self.out += frame(HEADERS, END_HEADERS, sid, fields)
            # The gRPC message's 5-byte prefix (not compressed, `size` bytes), then its bytes.
            self.left[sid] = bytearray(b"\x00" + struct.pack(">I", size)), size - 1
            self.window[sid] = None

    def done(self):
        """Every stream has sent what it will send, or was ended, or the connection was."""
        return self.closed or all(prefix == b"" and body == 0
                                  for prefix, body in self.left.values())

    def pump(self):
        if self.closed:
            return
        try:
            while self.out:
                del self.out[:self.sock.send(self.out)]
            data = self.sock.recv(1 << 20)
            if not data:
                self.closed = True
                return
            self.inbox += data
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except OSError:
            self.closed = True
            return
        self._read_frames()
        self._send_data()

    def _read_frames(self):
        while len(self.inbox) >= 9:
            length = int.from_bytes(self.inbox[:3], "big")
            if len(self.inbox) < 9 + length:
                return
            kind, flags = self.inbox[3], self.inbox[4]
            sid = int.from_bytes(self.inbox[5:9], "big") & 0x7fffffff
            payload, self.inbox = self.inbox[9:9 + length], self.inbox[9 + length:]
            if kind == SETTINGS and not flags & ACK:
                for at in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[at:at + 6])
                    if key == SETTINGS_INITIAL_WINDOW_SIZE:
                        for s, w in self.window.items():
                            if w is not None:
                                self.window[s] = w + value - self.initial_window
                        self.initial_window = value
                self.out += frame(SETTINGS, ACK, 0)
            elif kind == PING and not flags & ACK:
                self.out += frame(PING, ACK, 0, payload)
            elif kind == WINDOW_UPDATE:
                grant = struct.unpack(">I", payload)[0] & 0x7fffffff
                if sid == 0:
                    self.connection_window += grant
                elif sid in self.window:
                    w = self.window[sid]
                    self.window[sid] = (self.initial_window if w is None else w) + grant
            elif kind == RST_STREAM and sid in self.left:
                self.resets.append(struct.unpack(">I", payload)[0])
                del self.left[sid]
                del self.window[sid]
            elif kind == HEADERS and flags & END_STREAM and sid in self.left:
                self.answered += 1  # a reply of trailers alone: the call has ended
                del self.left[sid]
                del self.window[sid]
            elif kind == GOAWAY:
                self.closed = True
                return

    def _send_data(self):
        for sid, (prefix, body) in list(self.left.items()):
            if self.window[sid] is None:
                self.window[sid] = self.initial_window
            while (prefix or body) and len(self.out) < (4 << 20):
                room = min(self.window[sid], self.connection_window, 16384)
                if room <= 0:
                    break
                head = bytes(prefix[:room])
                del prefix[:len(head)]
                n = min(body, room - len(head))
                body -= n
                self.out += frame(DATA, 0, sid, head + b"\x5a" * n)
                self.window[sid] -= len(head) + n
                self.connection_window -= len(head) + n
            self.left[sid] = prefix, body


def rss_mb(pid):
    return rss_kib(pid) / 1024


def unix(daemon):
    def connect():
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        return s
    return connect


def flood(daemon, connect, connections, streams, size, seconds, token=None):
    """Half-sent messages on `connections` (each `connect()`) x `streams` streams until each has
    sent what it will (and a second more), at most `seconds`; the daemon's largest resident
    memory meanwhile (MB) and the senders."""
    senders = [HalfSender(connect(), streams, size, token) for _ in range(connections)]
    peak = rss_mb(daemon.proc.pid)
    deadline = time.time() + seconds
    settled = None
    while time.time() < deadline and daemon.proc.poll() is None:
        for s in senders:
            s.pump()
        peak = max(peak, rss_mb(daemon.proc.pid))
        if all(s.done() for s in senders):
            settled = settled or time.time()
            if time.time() - settled > 1:
                break
        time.sleep(0.001)
    return peak, senders


def echo(daemon):
    stub = pb_grpc.KvTierStub(grpc.insecure_channel(daemon.address))
    return stub.Echo(pb.EchoRequest(payload=b"after"), timeout=10).payload


def test_half_sent_messages_hold_at_most_max_rpc_buffer_size(start_daemon):
    """gRPC holds a half-sent message until its call ends: a 64M bound keeps 32 of them (384 MiB)
    to about its size, where an unbounded transport holds them all."""
    connections, streams, size = 4, 8, 12 << 20  # 384 MiB of messages, none of them finished
    held = connections * streams * size / (1 << 20)

    # Unbounded in effect (1T): gRPC holds every message, as it did before the bound. This is
    # what the bound is for, and shows that the flood below reaches the daemon.
    d = start_daemon("--max_message_size", "16M", "--max_rpc_buffer_size", "1T")
    start = rss_mb(d.proc.pid)
    peak, senders = flood(d, unix(d), connections, streams, size, 60)
    assert peak - start > 0.8 * held, (start, peak)
    assert not any(s.resets for s in senders)
    for s in senders:
        s.sock.close()
    assert d.stop() == 0

    # 64M: the daemon's memory stays near it (a soft bound: gRPC reclaims once it is passed,
    # so a margin). gRPC resets streams (ENHANCE_YOUR_CALM: their callers see
    # RESOURCE_EXHAUSTED), closes connections or stops granting window to stay under, the
    # daemon lives, and a call afterwards is answered.
    d = start_daemon("--max_message_size", "16M", "--max_rpc_buffer_size", "64M")
    start = rss_mb(d.proc.pid)
    peak, senders = flood(d, unix(d), connections, streams, size, 60)
    assert peak - start < 3 * 64, (start, peak)
    resets = [code for s in senders for code in s.resets]
    unsent = sum(body for s in senders for _, body in s.left.values())
    assert resets or any(s.closed for s in senders) or unsent > 0
    assert set(resets) <= {ENHANCE_YOUR_CALM}, resets
    assert d.proc.poll() is None
    assert echo(d) == b"after"
    for s in senders:
        s.sock.close()


def test_a_tls_caller_without_credentials_ends_before_its_message_is_read(start_tcp_daemon,
                                                                          pki):
    """Over TLS a kvtier call's bearer token is checked when its headers arrive: 32 half-sent
    12 MiB messages without one end there (UNAUTHENTICATED, with the words the service's check
    gives, logged as a failed call) and the daemon holds none of them; the health check still
    answers without a token; the same flood with the token is held, as any authenticated
    caller's is (within --max_rpc_buffer_size)."""
    token = "transport-" + os.urandom(8).hex()
    salt = os.urandom(16).hex()
    config = pki / "tls.conf"
    config.write_text(
        f'tls {{ cert_file: "{pki}/server.pem" key_file: "{pki}/server.key" }}\n'
        f'auth {{ tokens {{ tenant: "carol" salt: "{salt}" '
        f'sha256: "{hashlib.sha256((salt + token).encode()).hexdigest()}" }} }}\n')
    d, port = start_tcp_daemon("--config", str(config), "--max_message_size", "16M",
                               "--max_rpc_buffer_size", "1G", "--log_level", "info")
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.set_alpn_protocols(["h2"])

    def tls():
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)  # the handshake too
        return context.wrap_socket(raw, server_hostname="127.0.0.1")

    connections, streams, size = 4, 8, 12 << 20
    held = connections * streams * size / (1 << 20)
    start = rss_mb(d.proc.pid)
    peak, senders = flood(d, tls, connections, streams, size, 60)
    assert sum(s.answered + len(s.resets) for s in senders) == connections * streams, \
        [(s.answered, s.resets, s.closed) for s in senders]
    assert peak - start < 64, (start, peak)
    for s in senders:
        s.sock.close()
    assert "event=rpc.error method=Echo code=UNAUTHENTICATED" in d.log.read_text()

    tls_ca = dict(tls_ca=str(pki / "ca.pem"))
    with kvtier.Client(f"127.0.0.1:{port}", timeout=10, **tls_ca) as anonymous, \
            pytest.raises(kvtier.KvTierError) as e:
        anonymous.list_sessions()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "a TCP caller needs credentials" in e.value.message
    # The health check answers anyone, as over the Unix socket (probes carry no token).
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(
            (pki / "ca.pem").read_bytes())) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"", timeout=10) == b"\x08\x01"  # HealthCheckResponse{status: SERVING}
    with kvtier.Client(f"127.0.0.1:{port}", timeout=10, token=token, **tls_ca) as carol:
        assert [s.tenant for s in carol.list_sessions()] == []
        carol.create_session(2, 9, 3, 64)
        assert [s.tenant for s in carol.list_sessions()] == ["carol"]

    # With the token, the same flood reaches the service's calls and is held until they end.
    start = rss_mb(d.proc.pid)
    peak, senders = flood(d, tls, connections, streams, size, 60, token=token)
    assert peak - start > 0.8 * held, (start, peak)
    for s in senders:
        s.sock.close()


# Run as another uid by /usr/bin/python3 (stdlib only): opens argv[1] connections to the socket
# argv[2], each sending HTTP/2's preface, prints how many the daemon kept (answered with its
# SETTINGS rather than closed), and holds them until its stdin closes.
CONNECT = r"""
import socket, sys
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sys.argv[2])
    try:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    except BrokenPipeError:  # closed as accepted
        pass
    held.append(s)
kept = 0
for s in held:
    try:
        kept += len(s.recv(9)) == 9
    except ConnectionResetError:
        pass
print(kept, flush=True)
sys.stdin.read()
"""


def test_a_uid_holds_at_most_max_connections_per_uid(start_daemon):
    """Connections of a uid past --max_connections_per_uid are closed as they are accepted,
    counted and logged; each uid has its own bound, the daemon's own uid none, and a uid whose
    connections closed connects again. Other uids are played by /usr/bin/python3 run as them,
    so the test needs root."""
    if os.getuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root and /usr/bin/python3 to connect as other uids")
    port = free_port()
    d = start_daemon("--max_connections_per_uid", "4", "--metrics_port", str(port))
    # The test reaches past the socket's 0660 and, through /proc/self/fd, its private directory.
    os.chmod(d.socket, 0o666)
    path = os.open(d.socket, os.O_PATH)
    holders = []

    def connect_as(uid, n):
        p = subprocess.Popen(["/usr/bin/python3", "-c", CONNECT, str(n), f"/proc/self/fd/{path}"],
                             pass_fds=[path], user=uid, group=uid, extra_groups=[],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holders.append(p)
        return p, int(p.stdout.readline())

    def let_go(p):
        p.stdin.close()
        assert p.wait(timeout=30) == 0
        p.stdout.close()

    def refused():
        return counter(port, "kvtier_unix_connections_refused_total")

    deadline = time.monotonic() + 10
    while True:  # the metrics port opens a moment after the socket
        try:
            refused()
            break
        except OSError:
            assert time.monotonic() < deadline, "no metrics port"
            time.sleep(0.05)
    try:
        nobody, kept = connect_as(65534, 7)
        assert kept == 4
        assert refused() == 3
        log = d.log.read_text()
        assert "event=listen.refused uid=65534" in log and "limit=4" in log, log
        # Another uid has a bound of its own; the daemon's own uid has none.
        _, kept = connect_as(65533, 6)
        assert kept == 4
        _, kept = connect_as(0, 7)
        assert kept == 7
        with kvtier.Client(d.address, timeout=10) as c:
            assert c.list_sessions() == []
        assert refused() == 5
        # Once its connections close, the uid connects again (the daemon notices the close
        # within moments; a try before then is refused in part, and its connections close too).
        let_go(nobody)
        deadline = time.monotonic() + 20
        while True:
            again, kept = connect_as(65534, 4)
            if kept == 4 or time.monotonic() > deadline:
                break
            let_go(again)
            time.sleep(0.2)
        assert kept == 4
    finally:
        for p in holders:
            if not p.stdin.closed:
                p.stdin.close()
            p.stdout.close()
            if p.poll() is None:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        os.close(path)


# Run as another uid by /usr/bin/python3: connects argv[2] sockets to argv[1] and hands them over
# the socket whose descriptor is argv[3] (SCM_RIGHTS), so that the test's own process speaks on
# connections the daemon knows as that uid's.
HAND_OVER = r"""
import socket, sys
path, n, back = sys.argv[1], int(sys.argv[2]), socket.socket(fileno=int(sys.argv[3]))
held = [socket.socket(socket.AF_UNIX) for _ in range(n)]
for s in held:
    s.connect(path)
socket.send_fds(back, [b"x"], [s.fileno() for s in held])
"""


def test_a_uid_granted_nothing_is_served_apart_from_the_daemons_calls(start_daemon):
    """A uid the config grants nothing (no token configured, the uid in no entry) can only be
    refused: its connections go to a server of their own, so its half-sent messages never
    reach the daemon's transport bound, which here is unbounded in effect (1T), and gRPC
    holds little of them. Its calls are refused with the service's words, logged, and its
    health check answers. Other uids are played by processes run as them: the test needs
    root."""
    if os.getuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root and /usr/bin/python3 to connect as other uids")
    d = start_daemon("--max_message_size", "16M", "--max_rpc_buffer_size", "1T",
                     "--log_level", "info")
    os.chmod(d.socket, 0o666)  # the test reaches past the socket's 0660
    path = os.open(d.socket, os.O_PATH)  # and, through /proc/self/fd, its private directory
    tools = tempfile.mkdtemp()
    try:
        connections, streams, size = 4, 8, 12 << 20
        ours, theirs = socket.socketpair()
        try:
            subprocess.run(["/usr/bin/python3", "-c", HAND_OVER, f"/proc/self/fd/{path}",
                            str(connections), str(theirs.fileno())],
                           pass_fds=[path, theirs.fileno()], user=65534, group=65534,
                           extra_groups=[], check=True, timeout=30)
            _, fds, _, _ = socket.recv_fds(ours, 1, connections)
        finally:
            ours.close()
            theirs.close()
        handed = [socket.socket(fileno=fd) for fd in fds]
        assert len(handed) == connections

        start = rss_mb(d.proc.pid)
        peak, senders = flood(d, handed.pop, connections, streams, size, 60)
        # Every call ends at its headers, answered (its message never taken in).
        assert sum(s.answered for s in senders) == connections * streams, \
            [(s.answered, s.resets, s.closed) for s in senders]
        assert peak - start < 64, (start, peak)
        for s in senders:
            s.sock.close()
        log = d.log.read_text()
        assert "event=rpc.error method=Echo code=UNAUTHENTICATED" in log
        assert "uid 65534 (pid" in log

        # The service's words reach a client of that uid, the health check answers it, and the
        # daemon's own uid is served as ever.
        os.chmod(tools, 0o755)
        ctl = shutil.copy(BIN / "kvtierctl", tools)
        as_nobody = dict(pass_fds=[path], user=65534, group=65534, extra_groups=[],
                         capture_output=True, text=True, timeout=60)
        addr = ["--addr", f"unix:/proc/self/fd/{path}"]
        r = subprocess.run([ctl, *addr, "sessions"], **as_nobody)
        assert r.returncode == 1 and "UNAUTHENTICATED: uid 65534" in r.stderr, r
        assert "auth.unix_peers" in r.stderr
        r = subprocess.run([ctl, *addr, "health"], **as_nobody)
        assert r.returncode == 0, r
    finally:
        shutil.rmtree(tools)
        os.close(path)
    assert echo(d) == b"after"
