"""kvtier.Client: typed calls to kvtierd taking and returning numpy arrays."""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import select
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import grpc
import numpy as np

from kvtier import cuda
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

_DTYPES = {"fp16": (pb.DTYPE_FP16, np.float16), "bf16": (pb.DTYPE_BF16, np.uint16)}
_TIERS = {None: pb.TIER_UNSPECIFIED, "device": pb.TIER_DEVICE, "host": pb.TIER_HOST,
          "remote": pb.TIER_REMOTE}


class KvTierError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `message` the server's words."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class KvTierArgumentError(KvTierError, ValueError):
    """A mistake in a call's arguments, found before anything was sent: INVALID_ARGUMENT,
    the message starting with the argument's name. Also a ValueError."""

    def __init__(self, argument: str, problem: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{argument}: {problem}")
        self.argument = argument


def _choice(argument: str, table: dict, value):
    """table[value], or KvTierArgumentError naming `argument` and what it may be."""
    try:
        return table[value]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(k) for k in table)
        raise KvTierArgumentError(argument, f"{value!r} is not one of {allowed}") from None


_CARRIERS = {"parts": pb.CHUNK_CARRIER_PARTS, "nccl": pb.CHUNK_CARRIER_NCCL,
             "socket": pb.CHUNK_CARRIER_SOCKET}


def _move_timeout(a: float | None, b: float | None) -> float | None:
    """A move's bound on each part's wait: the shorter of the two clients' timeouts."""
    given = [t for t in (a, b) if t is not None]
    return min(given) if given else None


def _stalled(session_id: str, timeout: float) -> str:
    return (f"move_session of session_id \"{session_id}\": nothing moved for {timeout:g} s: "
            "a daemon or the link stalled; nothing imported")


def _carrier(value) -> int:
    """move_session's carrier as its enum value, or KvTierArgumentError naming it."""
    return _choice("carrier", _CARRIERS, value)


def _msg(cls, **fields):
    """cls(**fields); a field protobuf refuses (an unknown name, a value of the wrong type or
    out of its range) is a KvTierArgumentError naming it, before anything is sent."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        for name, value in fields.items():  # which one: each alone
            try:
                cls(**{name: value})
            except (TypeError, ValueError) as one:
                raise KvTierArgumentError(name, f"{value!r}: {one}") from None
        raise KvTierArgumentError(cls.DESCRIPTOR.name, str(e)) from None


def _query(query) -> np.ndarray:
    """A query as contiguous fp32, or KvTierArgumentError naming it."""
    try:
        return np.ascontiguousarray(query, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise KvTierArgumentError("query", f"not an fp32 array [num_q_heads][head_dim]: {e}") \
            from None


def _metadata(tenant: str | None, token: str | None) -> tuple:
    """The metadata every call carries: the tenant it names, the bearer token."""
    return ((("x-kvtier-tenant", tenant),) if tenant else ()) + \
        ((("authorization", "Bearer " + token),) if token else ())


def _channel_setup(tls_ca, tls_cert, tls_key, max_message_bytes):
    """(TLS credentials or None, channel options), the arguments checked."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    if tls_ca is None:
        if tls_cert is not None or tls_key is not None:
            raise KvTierArgumentError("tls_ca", "tls_cert and tls_key need tls_ca")
        return None, options
    if (tls_cert is None) != (tls_key is None):
        raise KvTierArgumentError("tls_cert", "tls_cert and tls_key: both or neither")

    def read(argument, path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise KvTierArgumentError(argument, f"cannot read {path}: {e.strerror}") from None
    creds = grpc.ssl_channel_credentials(
        root_certificates=read("tls_ca", tls_ca),
        private_key=read("tls_key", tls_key) if tls_key is not None else None,
        certificate_chain=read("tls_cert", tls_cert) if tls_cert is not None else None)
    return creds, options


def _create_session_request(num_layers, num_q_heads, num_kv_heads, head_dim, dtype, session_id,
                            model_id, labels, policy) -> pb.CreateSessionRequest:
    shape = _msg(pb.ModelShape, num_layers=num_layers, num_q_heads=num_q_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim,
                 dtype=_choice("dtype", _DTYPES, dtype)[0], model_id=model_id)
    return _msg(pb.CreateSessionRequest, session_id=session_id, shape=shape,
                policy=_msg(pb.SessionPolicy, **policy), labels=labels or {})


def _checked_items(items) -> list:
    """append_kv's items as (layer, start, keys, values, token_ids), every one checked before a
    stream starts: a mistake is the call's error, naming the item, and nothing of it is sent
    (the stream would otherwise end in UNKNOWN, some items applied)."""
    checked = []
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise KvTierArgumentError(
            "items", "must be a sequence of (layer, start_token, keys, values[, token_ids])")
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) not in (4, 5):
            raise KvTierArgumentError(
                f"items[{i}]", "must be (layer, start_token, keys, values[, token_ids])")
        layer, start, k, v = item[:4]
        ids = item[4] if len(item) > 4 else None
        for name, x in (("layer", layer), ("start_token", start)):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise KvTierArgumentError(f"items[{i}].{name}", f"{x!r} is not an integer")
        if ids is not None:
            try:
                ids = [int(t) for t in ids]
            except (TypeError, ValueError):
                raise KvTierArgumentError(f"items[{i}].token_ids",
                                          f"{ids!r} is not a sequence of integers") from None
        k, v = _little_endian(np.ascontiguousarray(k)), _little_endian(np.ascontiguousarray(v))
        for name, a in (("keys", k), ("values", v)):
            if a.ndim != 3:
                raise KvTierArgumentError(f"items[{i}].{name}",
                                          f"shape {a.shape} is not [kv_heads][tokens][head_dim]")
            if a.dtype.itemsize != 2:
                raise KvTierArgumentError(f"items[{i}].{name}",
                                          f"dtype {a.dtype} is not 2 bytes (fp16 or bf16)")
        if k.shape != v.shape:
            raise KvTierArgumentError(f"items[{i}].values",
                                      f"shape {v.shape} differs from keys' {k.shape}")
        if ids is not None and len(ids) != k.shape[1]:
            raise KvTierArgumentError(f"items[{i}].token_ids",
                                      f"{len(ids)} ids for {k.shape[1]} tokens")
        checked.append((int(layer), int(start), k, v, ids))
    return checked


def _append_request(session_id, layer, start, k, v, ids, wait_aged) -> pb.AppendKVRequest:
    return _msg(pb.AppendKVRequest, session_id=session_id, layer=layer, start_token=start,
                num_tokens=k.shape[1], token_ids=[] if ids is None else ids, wait_aged=wait_aged)


def _little_endian(a: np.ndarray) -> np.ndarray:
    """`a` with its values in little-endian order, as the daemon reads them (a big-endian
    array's values converted, never its bytes sent as they are)."""
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


def _as_array(argument: str, a) -> np.ndarray:
    """`a` as an ndarray, or KvTierArgumentError naming it."""
    try:
        return np.asarray(a)
    except (TypeError, ValueError) as e:
        raise KvTierArgumentError(argument, f"not an array: {e}") from None


def _layer_items(start, keys, values):
    """append_layers' arrays [layers][kv_heads][tokens][d] as append_kv items, checked."""
    for name, a in (("keys", keys), ("values", values)):
        if np.ndim(a) != 4:
            raise KvTierArgumentError(
                name, f"shape {np.shape(a)} is not [layers][kv_heads][tokens][head_dim]")
    if np.shape(keys) != np.shape(values):
        raise KvTierArgumentError("values", f"shape {np.shape(values)} differs from keys' "
                                  f"{np.shape(keys)}")
    return lambda: ((layer, start, keys[layer], values[layer]) for layer in range(keys.shape[0]))


def _select_request(session_id, layer, query, budget_tokens, placement, include_data, lease_ms,
                    include_summaries, row_handles, worker_id="",
                    release_lease_ids=()) -> pb.SelectRequest:
    q = _query(query)
    if isinstance(release_lease_ids, (str, bytes)) or not isinstance(release_lease_ids, Iterable):
        raise KvTierArgumentError("release_lease_ids",
                                  f"{release_lease_ids!r} is not a sequence of lease ids")
    return _msg(pb.SelectRequest,
        session_id=session_id, layer=layer, query=q.tobytes(), budget_tokens=budget_tokens,
        placement=_choice("placement", _TIERS, placement), include_data=include_data,
        lease_ms=lease_ms, include_summaries=include_summaries, row_handles=row_handles,
        worker_id=worker_id, release_lease_ids=list(release_lease_ids))


def _read_chunks_request(session_id, chunk_ids) -> pb.ReadChunksRequest:
    if isinstance(chunk_ids, (str, bytes)) or not isinstance(chunk_ids, Iterable):
        raise KvTierArgumentError("chunk_ids", f"{chunk_ids!r} is not a sequence of ids")
    return _msg(pb.ReadChunksRequest, session_id=session_id, chunk_ids=list(chunk_ids))


def _list_chunks_request(session_id, layer, limit) -> pb.ListChunksRequest:
    layer_field = {} if layer is None else {"layer": layer}  # unset: every layer
    return _msg(pb.ListChunksRequest, session_id=session_id, limit=limit, **layer_field)


def _evict_request(session_id, tier) -> pb.EvictRequest:
    return _msg(pb.EvictRequest, session_id=session_id, tier=_choice("tier", _TIERS, tier))


def _set_policy_request(session_id, policy) -> pb.SetPolicyRequest:
    return _msg(pb.SetPolicyRequest, session_id=session_id,
                policy=_msg(pb.SessionPolicy, **policy))


def _fork_request(session_id, num_tokens, new_session_id) -> pb.ForkSessionRequest:
    return _msg(pb.ForkSessionRequest, session_id=session_id, num_tokens=num_tokens,
                new_session_id=new_session_id)


# grpc.health.v1 Check of the whole server, as raw bytes: HealthCheckRequest{} is empty, and
# HealthCheckResponse{status: SERVING} is 08 01.
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = b"\x08\x01"


def _health_check(channel):
    """The Check method on `channel`, bytes in and out."""
    return channel.unary_unary(_HEALTH_CHECK, request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)


def _batch(requests) -> pb.BatchSelectRequest:
    """A BatchSelectRequest of SelectRequests, or KvTierArgumentError naming the one that is
    not."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise KvTierArgumentError("requests", "must be a sequence of SelectRequest")
    requests = list(requests)
    for i, r in enumerate(requests):
        if not isinstance(r, pb.SelectRequest):
            raise KvTierArgumentError(f"requests[{i}]",
                                      f"a {type(r).__name__}, not a kvtier.v1.SelectRequest")
    return pb.BatchSelectRequest(requests=requests)


def _check_client_args(address, timeout, max_message_bytes) -> None:
    """A client's address, timeout and message limit, checked before a channel is made."""
    if not isinstance(address, str) or not address:
        raise KvTierArgumentError("address", f"{address!r} is not \"unix:PATH\" or \"HOST:PORT\"")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise KvTierArgumentError("timeout", f"{timeout!r} is not a positive number of seconds")
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or \
            max_message_bytes <= 0:
        raise KvTierArgumentError("max_message_bytes", f"{max_message_bytes!r} is not a "
                                  "positive number of bytes")


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as e:  # every RpcError raised by a call is also a grpc.Call
        raise KvTierError(e.code(), e.details() or "") from None


def _within(fn, arg, timeout: float | None, metadata, name: str):
    """fn's call (on one request, or a stream of them) under `timeout`, its answer awaited at
    most a second longer: a call whose daemon stopped reading never ends by its deadline (a
    write into its connection ends only when it reads), and is cancelled then, raising
    DEADLINE_EXCEEDED."""
    call = fn.future(arg, timeout=timeout, metadata=metadata)
    try:
        return call.result(timeout=None if timeout is None else timeout + 1)
    except grpc.FutureTimeoutError:
        if not call.cancel() and call.done():
            return _within_result(call)
        raise _not_ended(name, timeout) from None
    except grpc.RpcError as e:
        raise KvTierError(e.code(), e.details() or "") from None
    except BaseException:  # an interrupt: the call does not go on
        call.cancel()
        raise


def _not_ended(name: str, timeout: float) -> KvTierError:
    """What a call given up a second past its timeout raises (_within; the asyncio client's)."""
    return KvTierError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"{name}: the call did not end within the client's timeout ({timeout:g} s) "
                       "and a second: a stalled daemon or link; the call is cancelled")


def _within_result(call):
    try:
        return call.result()
    except grpc.RpcError as e:
        raise KvTierError(e.code(), e.details() or "") from None


_LIKES = ("numpy", "torch")
_DEVICE_LIKES = ("cuda", "torch", "cupy")  # views of a GPU segment (kvtier.cuda)


def _torch():
    """torch, imported on first use: the client needs it only for torch views."""
    try:
        import torch
    except ImportError:
        raise KvTierArgumentError("like", "torch views need PyTorch, which is not installed") \
            from None
    return torch


_SHM_NAME = re.compile(r"/?kvtier-[A-Za-z0-9._-]+")


def _open_segment(seg: pb.Segment) -> int | None:
    """A read-only descriptor of a segment by its name, trusting nothing the daemon said: the
    name must be a kvtier segment's (one file of /dev/shm, no path), opened without following
    a link. None when this process may not open it (another uid's: segments are mode 0600),
    cannot find it (another /dev/shm: the daemon in a container) or finds another stamp in it
    (another daemon's file of that name): the caller asks for the descriptor then."""
    if not _SHM_NAME.fullmatch(seg.shm_name):
        raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"segment {seg.segment_id}: shm_name {seg.shm_name!r} is not a kvtier "
                          "segment name")
    try:
        fd = os.open("/dev/shm/" + seg.shm_name.lstrip("/"), os.O_RDONLY | os.O_NOFOLLOW)
    except (PermissionError, FileNotFoundError):
        return None
    except OSError as e:
        raise KvTierError(grpc.StatusCode.NOT_FOUND,
                          f"segment {seg.segment_id}: open {seg.shm_name}: {e.strerror}") from None
    if seg.stamp_offset and os.pread(fd, 8, seg.stamp_offset) != seg.stamp.to_bytes(8, "little"):
        os.close(fd)
        return None
    return fd


def _map_fd(segment_id: int, fd: int, size_bytes: int) -> mmap.mmap:
    """A read-only map of `fd` (closed here), once the memory holds the size the daemon gave
    (a map past a file's end faults when read)."""
    try:
        size = os.fstat(fd).st_size
        if size_bytes <= 0 or size_bytes > size:
            raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"segment {segment_id}: size_bytes {size_bytes} but its memory "
                              f"holds {size} bytes")
        return mmap.mmap(fd, size_bytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _picked(handle: pb.BlockHandle):
    """A handle's `rows` as an int64 array (None when it lists none: all of them), each checked
    inside its chunk (OUT_OF_RANGE otherwise)."""
    if not handle.rows:
        return None
    rows = np.asarray(handle.rows, np.int64)
    if rows.max() >= handle.num_tokens:
        raise KvTierError(grpc.StatusCode.OUT_OF_RANGE,
                          f"handle of chunk {handle.chunk_id}: row {rows.max()} of "
                          f"{handle.num_tokens}")
    return rows


class SegmentMap:
    """Read-only mmaps of the daemon's shared-memory segments, by segment id."""

    def __init__(self, client: "Client", cuda=None):
        """`cuda`: the CUDA IPC runtime for GPU segments (kvtier.cuda; default: CuPy's, else
        libcudart's, loaded on first use)."""
        self._client = client
        self._cuda = cuda
        self._gpu: dict[int, pb.Segment] = {}  # GPU segments as listed when mapped
        self._opened: dict[int, tuple[int, int, int]] = {}  # (pointer, device, stamp) by id
        self._retired: list[int] = []  # allocations set aside by _device_base, closed by prune
        self._maps: dict[int, mmap.mmap] = {}
        self._tables: dict[int, tuple[int, int]] = {}  # (slot_bytes, generation table offset)
        self._stamps: dict[int, int] = {}  # each segment's stamp, as listed when mapped
        self._halves: dict[int, np.ndarray] = {}  # each map as one read-only fp16 array
        self._tensors: dict = {}  # each map as one torch fp16 tensor, made on first use
        self._cells: dict[int, tuple] = {}  # (map, its generation table as a uint64 array)
        self._lock = threading.Lock()

    def holds(self, segment_ids: Iterable[int]) -> bool:
        """Whether every one of these segments is mapped already (reading them then asks the
        daemon nothing, unless a handle's generation is stale)."""
        with self._lock:
            return all(i in self._maps for i in segment_ids)

    def _segment(self, segment_id: int) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(segment_id)
        if m is not None:
            return m
        for seg in self._client.list_segments():
            if seg.segment_id != segment_id:
                continue
            gpu = bool(seg.cuda_ipc_handle)  # its slots are GPU memory (kvtier.cuda)
            if gpu and len(seg.cuda_ipc_handle) != cuda.IPC_HANDLE_BYTES:
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"segment {segment_id}: cuda_ipc_handle of "
                                  f"{len(seg.cuda_ipc_handle)} bytes, not {cuda.IPC_HANDLE_BYTES}")
            fd = _open_segment(seg) if seg.shm_name else None
            if fd is None:  # not ours to open by name: a read-only descriptor instead
                [(seg, fd)] = self._client.open_segments([segment_id])  # checked: this one
            # A GPU segment's host memory is its generation table and stamp alone.
            m = _map_fd(segment_id, fd, seg.stamp_offset + 8 if gpu else seg.size_bytes)
            with self._lock:
                if gpu:
                    self._gpu.setdefault(segment_id, seg)
                self._tables.setdefault(segment_id, (seg.slot_bytes, seg.generation_table_offset))
                self._stamps.setdefault(segment_id, seg.stamp)
                return self._maps.setdefault(segment_id, m)
        raise KvTierError(grpc.StatusCode.NOT_FOUND, f"segment_id {segment_id} is not listed")

    def halves(self, segment_id: int) -> np.ndarray:
        """The whole segment as a read-only array of 2-byte elements (fp16 view)."""
        a = self._halves.get(segment_id)
        if a is None:
            m = self._segment(segment_id)
            if segment_id in self._gpu:
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"segment {segment_id} is memory of CUDA device "
                                  f"{self._gpu[segment_id].device}: view its handles with "
                                  f"like=\"torch\", \"cupy\" or \"cuda\", or select with "
                                  f"include_data")
            a = np.frombuffer(m, dtype=np.float16, count=len(m) // 2)
            with self._lock:
                a = self._halves.setdefault(segment_id, a)
        return a

    def check(self, handle: pb.BlockHandle) -> None:
        """Raises ABORTED unless the handle's slot still holds the handle's generation: call
        after copying out of a view, so that bytes of a freed or reused slot are never used."""
        m = self._segment(handle.segment_id)
        slot_bytes, table = self._tables.get(handle.segment_id, (0, 0))
        if not slot_bytes:
            return  # a daemon without generation tables
        cell = table + 8 * (handle.offset // slot_bytes)
        if cell + 8 > len(m):
            raise KvTierError(grpc.StatusCode.OUT_OF_RANGE,
                              f"handle of chunk {handle.chunk_id} has no generation cell")
        now = int.from_bytes(m[cell:cell + 8], "little")
        if now != handle.generation:
            held = "nothing (freed)" if now == 0 else f"generation {now}"
            raise KvTierError(grpc.StatusCode.ABORTED,
                              f"stale handle: chunk {handle.chunk_id} (segment "
                              f"{handle.segment_id}, offset {handle.offset}) names generation "
                              f"{handle.generation} but the slot now holds {held}")

    def gather(self, handles: Sequence[pb.BlockHandle], head_dim: int, dtype=None):
        """(K, V): numpy copies [n][head_dim] of these host handles' rows, in order (a
        handle's `rows` when it lists some, else all of its rows), each slot checked against
        its handle's generation after the copy (ABORTED naming the first stale handle, as
        check() raises). Each handle's rows are one slice copied out of its mapped segment and
        the generations are compared as one array per segment, before the copy and after it,
        rather than a view and two checks a handle; handles that do not all fit that (another
        layout, a segment not yet mapped, a generation already stale before the copy: a segment
        id reused since it was mapped) are read a handle at a time through view() and check(),
        which remap or say what is wrong. A GPU segment's handle is FAILED_PRECONDITION (view it
        with like="torch", "cupy" or "cuda"). `dtype`: the
        2-byte values' numpy type; by default float16, or uint16 (the bits, as append takes
        them) when a handle is PRECISION_BF16."""
        if dtype is None:
            dtype = np.uint16 if any(h.precision == pb.PRECISION_BF16 for h in handles) \
                else np.float16
        total = sum(len(h.rows) or h.num_tokens for h in handles)
        fast = self._gather_runs(handles, head_dim, np.dtype(dtype), total)
        if fast is not None:
            return fast
        keys = np.empty((total, head_dim), dtype)
        values = np.empty((total, head_dim), dtype)
        at = 0
        for h in handles:
            self.halves(h.segment_id)  # maps it; FAILED_PRECONDITION for GPU memory
            k, v = self.view(h, head_dim, dtype=dtype)
            rows = _picked(h)
            if rows is not None:
                k, v = k[rows], v[rows]
            keys[at:at + len(k)] = k
            values[at:at + len(v)] = v
            self.check(h)  # the copy is the chunk's only if the slot is unchanged
            at += len(k)
        return keys, values

    @staticmethod
    def positions(handles: Sequence[pb.BlockHandle]) -> np.ndarray:
        """The positions (int64 [n]) of these handles' rows, in order (a handle's `rows` when it
        lists some, else all of its rows), as gather() reads them; OUT_OF_RANGE for a handle
        whose positions are not one a token, or whose rows lie outside its chunk."""
        runs = []
        for b in handles:
            if len(b.positions) != b.num_tokens:
                raise KvTierError(grpc.StatusCode.OUT_OF_RANGE,
                                  f"handle of chunk {b.chunk_id}: {len(b.positions)} positions "
                                  f"for {b.num_tokens} tokens")
            p = np.asarray(b.positions, np.int64)
            rows = _picked(b)
            runs.append(p if rows is None else p[rows])
        return np.concatenate(runs) if runs else np.empty(0, np.int64)

    def on_device(self, handles: Iterable[pb.BlockHandle]) -> bool:
        """Whether any of these handles names GPU memory (a device tier's segment), mapping
        their segments first where they are not yet."""
        ids = {h.segment_id for h in handles}
        for sid in ids:
            self._segment(sid)
        return any(sid in self._gpu for sid in ids)

    def _generation_cells(self, segment_id: int):
        """(the segment's map, slot_bytes, its generation table as a uint64 array over that
        same map) of a mapped host segment, taken together (a segment remapped meanwhile by
        another thread never pairs one map's bytes with another's table), or None (not mapped,
        a GPU segment, no tables, or no whole cell)."""
        with self._lock:
            m = self._maps.get(segment_id)
            slot_bytes, table = self._tables.get(segment_id, (0, 0))
            cached = self._cells.get(segment_id)
            gpu = segment_id in self._gpu  # its map holds the table and stamp alone
        if m is None or gpu or not slot_bytes or table % 8 or len(m) - table < 8:
            return None
        if cached is not None and cached[0] is m:
            return m, slot_bytes, cached[1]
        cells = np.frombuffer(m, dtype=np.uint64, count=(len(m) - table) // 8, offset=table)
        with self._lock:
            if self._maps.get(segment_id) is m:  # not remapped meanwhile
                self._cells[segment_id] = (m, cells)
        return m, slot_bytes, cells

    @staticmethod
    def _stale(probes) -> int:
        """The index of the first handle whose slot does not hold its generation now (or whose
        cell lies past its table), -1 if none: each cell read once. `probes`: per segment,
        (its table, the handles' indices, their slots, their generations)."""
        first = -1
        for table, at, slot, want in probes:
            inside = slot < len(table)
            bad = np.flatnonzero(~inside | (table[np.where(inside, slot, 0)] != want))
            if len(bad):
                i = int(at[bad[0]])
                first = i if first < 0 else min(first, i)
        return first

    def _gather_runs(self, handles, head_dim: int, dtype: np.dtype, total: int):
        """gather()'s one-pass path, or None where it does not apply."""
        if not handles or head_dim <= 0 or dtype.itemsize != 2:
            return None
        rows_of, cells, slot_bytes = {}, {}, {}
        for sid in {h.segment_id for h in handles}:
            got = self._generation_cells(sid)
            if got is None:
                return None  # the per-handle path maps it (or refuses device memory)
            m, slot_bytes[sid], cells[sid] = got
            a = np.frombuffer(m, dtype=dtype, count=len(m) // 2)
            rows_of[sid] = a[:len(a) // head_dim * head_dim].reshape(-1, head_dim)
        row_bytes = 2 * head_dim
        # (segment, first K row, tokens, picked rows (none: all), slot, generation) a handle.
        plan = []
        for h in handles:
            sid, offset, n, rows = h.segment_id, h.offset, h.num_tokens, h.rows
            # Whole rows of its segment, K then V, inside it.
            if offset % row_bytes or h.length != 2 * row_bytes * n or \
                    (offset + h.length) // row_bytes > len(rows_of[sid]) or \
                    (rows and max(rows) >= n):
                return None
            plan.append((sid, offset // row_bytes, n, rows, offset // slot_bytes[sid],
                         h.generation))
        probes = []
        for sid, table in cells.items():
            at = [i for i, p in enumerate(plan) if p[0] == sid]
            probes.append((table, at, np.array([plan[i][4] for i in at], np.int64),
                           np.array([plan[i][5] for i in at], np.uint64)))
        if self._stale(probes) != -1:
            return None  # view() remaps or names it
        keys = np.empty((total, head_dim), dtype)
        values = np.empty((total, head_dim), dtype)
        at = 0
        for sid, first, n, picked, _, _ in plan:
            rows = rows_of[sid]
            if picked:
                pick = first + np.asarray(picked, np.int64)
                m = len(pick)
                keys[at:at + m] = rows[pick]
                values[at:at + m] = rows[pick + n]
            else:
                m = n
                keys[at:at + m] = rows[first:first + n]
                values[at:at + m] = rows[first + n:first + 2 * n]
            at += m
        stale = self._stale(probes)
        if stale != -1:
            self.check(handles[stale])  # raises ABORTED (or OUT_OF_RANGE) naming it
            raise KvTierError(grpc.StatusCode.ABORTED,
                              f"stale handle: chunk {handles[stale].chunk_id}")
        return keys, values

    def _checked(self, handle: pb.BlockHandle) -> None:
        """check(), except that a mapping of what the id named before (a retired segment, a
        daemon since restarted and reusing the id: the daemon lists it with another stamp, or
        not at all) is dropped and the segment mapped anew, once; never read for the handle."""
        try:
            self.check(handle)
            return
        except KvTierError as e:
            if e.code not in (grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE):
                raise
            stamp = self._stamps.get(handle.segment_id)
            listed = [s.stamp for s in self._client.list_segments()
                      if s.segment_id == handle.segment_id]
            if listed and listed[0] == stamp:
                raise  # the same segment: the handle is stale
        with self._lock:
            self._forget(handle.segment_id)
        self.check(handle)

    def _forget(self, segment_id: int) -> None:
        """Drops what this map holds of a segment (the caller holds the lock); views already
        made keep the old host mapping alive."""
        for cache in (self._maps, self._tables, self._stamps, self._halves, self._tensors,
                      self._cells, self._gpu):
            cache.pop(segment_id, None)

    def _runtime(self):
        if self._cuda is None:
            try:
                self._cuda = cuda.default_runtime()
            except cuda.CudaUnavailable as e:
                raise KvTierArgumentError("like", f"views of GPU segments need CUDA: {e}") \
                    from None
        return self._cuda

    def _device_base(self, seg: pb.Segment) -> tuple[int, int]:
        """(pointer, device) of a GPU segment's allocation, opened once per stamp: one
        opened under another stamp (what the id named before) is set aside, since views of it
        may still be read (another thread's, a kernel queued), and closed by prune."""
        with self._lock:
            opened = self._opened.get(seg.segment_id)
            if opened is not None and opened[2] == seg.stamp:
                return opened[0], opened[1]
            if opened is not None:
                self._retired.append(opened[0])
                del self._opened[seg.segment_id]
            try:
                ptr, dev = self._runtime().open(bytes(seg.cuda_ipc_handle))
            except OSError as e:
                raise KvTierError(grpc.StatusCode.UNAVAILABLE,
                                  f"segment {seg.segment_id}: {e}") from None
            self._opened[seg.segment_id] = (ptr, dev, seg.stamp)
            return ptr, dev

    def prune(self) -> int:
        """Closes the GPU allocations of segments the daemon no longer lists (or lists with
        another stamp) and those set aside, and drops the host mappings of such segments (each
        unmapped once no view holds it); how many allocations it closed. Views over them must
        not be read after this."""
        listed = {s.segment_id: s.stamp for s in self._client.list_segments()}
        with self._lock:
            retired, self._retired = self._retired, []
            closed = len(retired)
            for ptr in retired:
                self._runtime().close(ptr)
            for sid, (ptr, _, stamp) in list(self._opened.items()):
                if listed.get(sid) != stamp:
                    self._runtime().close(ptr)
                    del self._opened[sid]
                    closed += 1
            for sid, stamp in list(self._stamps.items()):
                if listed.get(sid) != stamp:
                    self._forget(sid)
        return closed

    def close(self) -> None:
        """Closes every GPU allocation this map opened."""
        with self._lock:
            for ptr in [p for p, _, _ in self._opened.values()] + self._retired:
                self._runtime().close(ptr)
            self._opened.clear()
            self._retired = []

    def _device_view(self, seg: pb.Segment, handle: pb.BlockHandle, head_dim: int, like: str):
        if like not in _DEVICE_LIKES:
            raise KvTierArgumentError("like", f"segment {handle.segment_id} is GPU memory: "
                                      f"{like!r} is not one of {', '.join(_DEVICE_LIKES)}")
        n = handle.num_tokens * head_dim
        if handle.offset % 2 or handle.length != 4 * n or \
                handle.offset + handle.length > seg.size_bytes:
            raise KvTierError(grpc.StatusCode.OUT_OF_RANGE,
                              f"handle of chunk {handle.chunk_id} does not fit its segment")
        base, dev = self._device_base(seg)
        # A bf16 session's bits: torch's bfloat16, else 2-byte integers (no other array type
        # every consumer knows has bf16).
        bf16 = handle.precision == pb.PRECISION_BF16
        typestr = "<u2" if bf16 and like != "torch" else "<f2"
        k = cuda.CudaArray(base + handle.offset, handle.num_tokens, head_dim, dev, typestr)
        v = cuda.CudaArray(base + handle.offset + 2 * n, handle.num_tokens, head_dim, dev,
                           typestr)
        k, v = cuda.as_like(k, like), cuda.as_like(v, like)
        if bf16 and like == "torch":
            torch = _torch()
            k, v = k.view(torch.bfloat16), v.view(torch.bfloat16)
        return k, v

    def _tensor(self, segment_id: int):
        """The whole segment as one torch fp16 tensor over the same mapping (DLPack, no copy)."""
        t = self._tensors.get(segment_id)
        if t is None:
            t = _torch().from_dlpack(self.halves(segment_id))  # read-only array: no copy
            with self._lock:
                t = self._tensors.setdefault(segment_id, t)
        return t

    def view(self, handle: pb.BlockHandle, head_dim: int, dtype=None, like: str = "numpy"):
        """K and V of `handle` as read-only [num_tokens][head_dim] views over shared memory:
        numpy arrays, or torch tensors with like="torch" (the same bytes, through DLPack; torch
        has no read-only tensors, and writing to one faults). Either exports DLPack
        (`np.from_dlpack`, `torch.from_dlpack`). A handle on a GPU segment gives device arrays
        over the daemon's allocation (kvtier.cuda): torch tensors (like="torch"), CuPy arrays
        (like="cupy") or `__cuda_array_interface__` objects (like="cuda"). The values are
        fp16, or a bf16 session's bits (PRECISION_BF16 handles): uint16 in numpy (as append
        takes them) and in device arrays, torch.bfloat16 in torch; `dtype` reads a host
        handle's 2-byte values as another numpy type. Checked against the slot's generation
        first; call check() again after reading."""
        if like not in _LIKES + _DEVICE_LIKES:
            raise KvTierArgumentError("like", f"{like!r} is not one of "
                                      f"{', '.join(dict.fromkeys(_LIKES + _DEVICE_LIKES))}")
        self._checked(handle)
        seg = self._gpu.get(handle.segment_id)  # one lookup: prune may drop it meanwhile
        if seg is not None:
            return self._device_view(seg, handle, head_dim, like)
        n = handle.num_tokens * head_dim
        if like not in _LIKES:
            raise KvTierArgumentError("like", f"segment {handle.segment_id} is host memory: "
                                      f"{like!r} is not one of {', '.join(_LIKES)}")
        a = self.halves(handle.segment_id)
        if handle.offset % 2 or handle.offset + handle.length > 2 * len(a) or \
                handle.length != 4 * n:
            raise KvTierError(grpc.StatusCode.OUT_OF_RANGE,
                              f"handle of chunk {handle.chunk_id} does not fit its segment")
        o = handle.offset // 2
        bf16 = handle.precision == pb.PRECISION_BF16
        if like == "torch":
            if dtype is not None:
                raise KvTierArgumentError("dtype", "torch views are fp16, or bf16 for a bf16 "
                                          "session's handles")
            t = self._tensor(handle.segment_id)
            k = t[o:o + n].view(handle.num_tokens, head_dim)
            v = t[o + n:o + 2 * n].view(handle.num_tokens, head_dim)
            if bf16:
                k, v = k.view(_torch().bfloat16), v.view(_torch().bfloat16)
            return k, v
        if dtype is None:
            dtype = np.uint16 if bf16 else np.float16
        k, v = a[o:o + n], a[o + n:o + 2 * n]
        if dtype is not np.float16:
            k, v = k.view(dtype), v.view(dtype)
        return k.reshape(handle.num_tokens, head_dim), v.reshape(handle.num_tokens, head_dim)


class _Attachment:
    """An Attach stream held open by a thread of its own: the daemon's first message names
    this worker; the stream ends when the client closes (or its process dies), and with it
    every lease taken under the worker's id."""

    def __init__(self, stub: pb_grpc.KvTierStub, metadata):
        self._call = stub.Attach(pb.AttachRequest(), metadata=metadata)
        self._ready = threading.Event()
        self.worker_id = ""
        self.error: grpc.RpcError | None = None
        self.ended = False
        threading.Thread(target=self._hold, daemon=True, name="kvtier-attach").start()

    def _hold(self):
        try:
            for resp in self._call:
                if not self.worker_id:
                    self.worker_id = resp.worker_id
                    self._ready.set()
        except grpc.RpcError as e:
            self.error = e
        self.ended = True
        self._ready.set()

    def wait(self, timeout: float) -> str:
        """The worker id; "" against a daemon without Attach; KvTierError if it failed."""
        if not self._ready.wait(timeout):
            raise KvTierError(grpc.StatusCode.DEADLINE_EXCEEDED, "Attach: no worker id in time")
        if self.worker_id and not self.ended:
            return self.worker_id
        if self.error is not None and self.error.code() == grpc.StatusCode.UNIMPLEMENTED:
            return ""
        if self.error is not None:
            raise KvTierError(self.error.code(), self.error.details() or "")
        raise KvTierError(grpc.StatusCode.UNAVAILABLE, "Attach: the stream ended")

    def close(self):
        self._call.cancel()


@dataclass
class SessionHandle:
    """What create_session and fork_session return: the session's id and its policy as the
    daemon completed it (defaults filled in)."""
    session_id: str
    policy: pb.SessionPolicy


class Staging:
    """A session's staging area, mapped read-write in this process (Client.open_staging)."""

    def __init__(self, staging_id: int, buf: mmap.mmap):
        self.id = staging_id
        self.buffer = buf
        self.bytes = np.frombuffer(buf, dtype=np.uint8)  # a writable view of every byte

    @property
    def size(self) -> int:
        return len(self.buffer)

    def put(self, offset: int, array: np.ndarray) -> int:
        """Writes `array`'s bytes at `offset`; returns the offset after them."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.bytes[offset:offset + raw.size] = raw
        return offset + raw.size


# The Select channel's header (client/include/kvtier/channel_layout.h), little-endian.
_CHANNEL_HEADER = struct.Struct("<IIQQQQIIQQiI")
_CHANNEL_MAGIC, _CHANNEL_VERSION, _CHANNEL_HEADER_BYTES = 0x4843564B, 1, 4096
_OP_SELECT, _OP_BATCH_SELECT, _OP_RELEASE, _OP_APPEND_KV = 1, 2, 3, 4
# append_layers sends appends of at most this many tokens through a channel: up to about 64
# tokens a channel call per layer took half the time of one stream for every layer or less
# (SmolLM2's shape), and about the same at 256.
_CHANNEL_APPEND_TOKENS = 64
# An append request's bytes beside its K and V (ids, layer, start, framing; token_ids at
# most 64 x 5 bytes), kept free of the channel's request area.
_CHANNEL_APPEND_OVERHEAD = 1024
# The header's worker_cpu and serving_cpu (uint32 each, 1 + a CPU; 0: not said).
_WORKER_CPU_AT, _SERVING_CPU_AT = 72, 76
# How long a call served on its own CPU gives it up (sched_yield) before it sleeps.
_HAND_OVER_S = 0.05
_NORMAL_POLICIES = tuple(getattr(os, p) for p in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE")
                         if hasattr(os, p))


def _calling_cpu() -> int:
    """The CPU this thread runs on (glibc's sched_getcpu), or -1: unknown, or a real-time
    thread, whose yield would not let the daemon's thread run."""
    try:
        if os.sched_getscheduler(0) not in _NORMAL_POLICIES:
            return -1
        return int(_LIBC.sched_getcpu())
    except (AttributeError, OSError):
        return -1


_LIBC = ctypes.CDLL(None)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


class SelectChannel:
    """A shared-memory Select channel (Client.open_channel): select, batch_select, release and
    a decode loop's per-layer append without gRPC, as the client's tenant. One call at a time;
    `close()` (or the process's end) ends it, and the leases of its Selects with it."""

    def __init__(self, channel_id: int, worker_id: str, fds: list[int], timeout: float):
        self.id = channel_id
        self.worker_id = worker_id
        self._timeout = timeout
        # Reentrant: a call that times out closes the channel under it.
        self._lock = threading.RLock()
        self._seq = 0
        self._fds = fds
        # A channel never closed still hangs up once collected (its descriptors are plain ints).
        self._finalizer = weakref.finalize(self, _close_fds, fds)
        try:
            size = os.fstat(fds[0]).st_size
            self._mem = mmap.mmap(fds[0], size)
            # The header as 8-byte words: [6] is seq, [7] answered_seq (channel_layout.h).
            self._words = np.frombuffer(self._mem, dtype="<u8", count=9)
            (magic, version, self._req_off, self._req_cap, self._resp_off,
             self._resp_cap) = _CHANNEL_HEADER.unpack_from(self._mem, 0)[:6]
            def inside(off, n):
                return _CHANNEL_HEADER_BYTES <= off <= size and n <= size - off
            if (magic != _CHANNEL_MAGIC or version != _CHANNEL_VERSION
                    or not inside(self._req_off, self._req_cap)
                    or not inside(self._resp_off, self._resp_cap)):
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  "OpenChannel: the header is not a version-1 kvtier channel's")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Hangs up: the daemon ends the channel's thread and the leases it holds. Waits for
        a call another thread is making to end first."""
        with self._lock:
            self._words = None  # the view first: a map with views on it cannot close
            if getattr(self, "_mem", None) is not None:
                self._mem.close()
                self._mem = None
            self._finalizer()  # closes the descriptors, once
            self._fds = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, op: int, request, response):
        with self._lock:
            if not self._fds:
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"channel {self.id} is closed")
            raw = request.SerializeToString()
            if len(raw) > self._req_cap:
                raise KvTierError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"request: {len(raw)} bytes past channel {self.id}'s request "
                                  f"area of {self._req_cap}")
            self._mem[self._req_off:self._req_off + len(raw)] = raw
            self._seq += 1
            struct.pack_into("<II", self._mem, 40, op, len(raw))
            # Where this call comes from, so that a daemon that co-locates serves it here.
            cpu = _calling_cpu()
            here = cpu + 1 if cpu >= 0 else 0
            struct.pack_into("<I", self._mem, _WORKER_CPU_AT, here)
            # The seq last, as one 8-byte store (numpy's; struct writes byte by byte, and the
            # daemon, which may be watching it, would see the values between): it reads op and
            # request_bytes once the seq changes (x86 keeps stores in program order).
            self._words[6] = self._seq
            os.eventfd_write(self._fds[1], 1)
            deadline = time.monotonic() + self._timeout
            if here and struct.unpack_from("<I", self._mem, _SERVING_CPU_AT)[0] == here:
                # The daemon's thread waits on this CPU: the doorbell woke it here, and it
                # serves the call once this thread gives the CPU up.
                until = min(deadline, time.monotonic() + _HAND_OVER_S)
                while int(self._words[7]) != self._seq and time.monotonic() < until:
                    os.sched_yield()
            poller = select.poll()
            poller.register(self._fds[2], select.POLLIN)
            poller.register(self._fds[3], select.POLLIN)
            while True:
                if int(self._words[7]) == self._seq:  # answered_seq, one 8-byte load
                    code, got = struct.unpack_from("<iI", self._mem, 64)
                    break
                left = deadline - time.monotonic()
                events = dict(poller.poll(max(left, 0) * 1000)) if left > 0 else {}
                if not events:
                    self.close()
                    raise KvTierError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"channel {self.id}: no answer within {self._timeout} s")
                if self._fds[2] in events:
                    try:
                        os.eventfd_read(self._fds[2])
                    except BlockingIOError:
                        pass
                if self._fds[3] in events and int(self._words[7]) != self._seq:
                    self.close()
                    raise KvTierError(grpc.StatusCode.UNAVAILABLE,
                                      f"channel {self.id}: the daemon closed it")
            if got > self._resp_cap:
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"channel {self.id}: an answer past its response area")
            body = self._mem[self._resp_off:self._resp_off + got]
        if code != 0:
            status = {c.value[0]: c for c in grpc.StatusCode}.get(code, grpc.StatusCode.UNKNOWN)
            raise KvTierError(status, body.decode(errors="replace"))
        response.ParseFromString(body)
        return response

    def select(self, session_id: str, layer: int, query: np.ndarray, budget_tokens: int = 0,
               include_data: bool = False, row_handles: bool = True,
               **fields) -> pb.SelectResponse:
        """As Client.select; the lease is the channel's worker's unless `worker_id` is given."""
        req = _msg(pb.SelectRequest, session_id=session_id, layer=layer,
                   query=_query(query).tobytes(), budget_tokens=budget_tokens,
                   include_data=include_data, row_handles=row_handles, **fields)
        return self._call(_OP_SELECT, req, pb.SelectResponse())

    def batch_select(self, requests: Sequence[pb.SelectRequest]) -> pb.BatchSelectResponse:
        """Several Selects in one call through the channel, all or nothing."""
        return self._call(_OP_BATCH_SELECT, _batch(requests), pb.BatchSelectResponse())

    def release(self, lease_id: str) -> None:
        """Ends a lease: its handles may be reused from now on. NOT_FOUND once it ended."""
        self._call(_OP_RELEASE, _msg(pb.ReleaseRequest, lease_id=lease_id), pb.ReleaseResponse())

    def append(self, session_id: str, layer: int, start: int, keys: np.ndarray,
               values: np.ndarray, token_ids: Sequence[int] | None = None,
               wait_aged: bool = False) -> int:
        """One layer's append through the channel, as Client.append_kv of that one item
        (keys/values [kv_heads][tokens][head_dim] in the session's dtype): a decode loop's
        per-layer append without a gRPC call. Returns the tokens now stored in every layer."""
        item = (layer, start, keys, values) + (() if token_ids is None else (token_ids,))
        ((layer, start, k, v, ids),) = _checked_items([item])
        req = _append_request(session_id, layer, start, k, v, ids, wait_aged)
        req.keys = k.tobytes()
        req.values = v.tobytes()
        return self._call(_OP_APPEND_KV, req, pb.AppendKVResponse()).num_tokens


class Client:
    """A connection to kvtierd ("unix:PATH" or "HOST:PORT")."""

    def __init__(self, address: str = "unix:/tmp/kvtier.sock", tenant: str | None = None,
                 timeout: float = 60.0, max_message_bytes: int = 64 << 20, attach: bool = True,
                 token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None):
        """`attach`: from the first select on, hold an Attach stream open and name it in each
        select, so that this client's leases end as soon as it closes or its process dies,
        instead of at their TTL (against a daemon without Attach: TTL only). `token`: a bearer
        token of the daemon's auth.tokens, sent on every call; `tenant` may then only name its
        tenant (or any, for an admin's). `tls_ca`: speak TLS to a TCP address, trusting that CA
        (a PEM file); `tls_cert` and `tls_key`: this client's certificate for mTLS."""
        _check_client_args(address, timeout, max_message_bytes)
        self.address = address
        self.timeout = timeout
        self._metadata = _metadata(tenant, token)
        creds, options = _channel_setup(tls_ca, tls_cert, tls_key, max_message_bytes)
        self._channel = (grpc.secure_channel(address, creds, options=options) if creds
                         else grpc.insecure_channel(address, options=options))
        self.stub = pb_grpc.KvTierStub(self._channel)
        self.segments = SegmentMap(self)
        self._shapes: dict[str, pb.ModelShape] = {}
        self._attach = attach
        self._staging: dict[str, Staging] = {}  # append_layers' areas, by session
        self._staging_ok = True  # false once the daemon refused OpenStaging
        self._staging_lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._attachment: _Attachment | None = None
        # append_layers' channel for small appends (a decode loop's), opened at the first one.
        self._append_channel: SelectChannel | None = None
        self._append_channel_ok = True  # false once the daemon refused it
        self._append_channel_lock = threading.Lock()

    def close(self):
        """Ends this client: its Attach stream (and so its leases), the GPU allocations its
        views opened, then the channel."""
        with self._attach_lock:
            if self._attachment is not None:
                self._attachment.close()
        with self._append_channel_lock:
            if self._append_channel is not None:
                self._append_channel.close()
                self._append_channel = None
        self.segments.close()
        self._channel.close()

    def worker_id(self) -> str:
        """This client's worker id (attaching first if needed); "" when attach is off or the
        daemon has no Attach."""
        if not self._attach:
            return ""
        with self._attach_lock:
            if self._attachment is None or self._attachment.ended:
                self._attachment = _Attachment(self.stub, self._metadata)
            attachment = self._attachment
        worker = attachment.wait(self.timeout)
        if not worker:  # a daemon without Attach: not asked again
            self._attach = False
        return worker

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _unary(self, name: str, request):
        return _call(getattr(self.stub, name), request, timeout=self.timeout,
                     metadata=self._metadata)

    # Sessions ---------------------------------------------------------------------------

    def create_session(self, num_layers: int, num_q_heads: int, num_kv_heads: int,
                       head_dim: int, dtype: str = "fp16", session_id: str = "",
                       model_id: str = "", labels: dict[str, str] | None = None,
                       **policy) -> SessionHandle:
        """`policy` takes SessionPolicy fields (sink_tokens=16, recent_window=64, ...)."""
        req = _create_session_request(num_layers, num_q_heads, num_kv_heads, head_dim, dtype,
                                      session_id, model_id, labels, policy)
        shape = req.shape
        r = self._unary("CreateSession", req)
        self._shapes[r.session_id] = shape
        return SessionHandle(r.session_id, r.policy)

    def _shape(self, session_id: str) -> pb.ModelShape:
        if session_id not in self._shapes:
            self._shapes[session_id] = self.describe_session(session_id).info.shape
        return self._shapes[session_id]

    def append_kv(self, session_id: str,
                  items: Iterable[tuple[int, int, np.ndarray, np.ndarray]],
                  wait_aged: bool = False, staging: Staging | None = None) -> int:
        """Streams (layer, start_token, keys, values[, token_ids]), keys/values
        [kv_heads][n][head_dim] in the session's dtype, token_ids [n] (they feed boundary
        chunking); returns the tokens now stored in every layer. The daemon acknowledges once
        the rows are stored and selectable, and ages (quantizes, indexes) them in the
        background; `wait_aged`: once each layer's aged-out chunks are aged too. `staging`: the
        session's staging area (open_staging), large enough for every item's K and V: they are
        written into it and named there instead of sent (zero-copy ingest)."""
        checked = _checked_items(items)

        def requests() -> Iterator[pb.AppendKVRequest]:
            at = 0
            for layer, start, k, v, ids in checked:
                r = _append_request(session_id, layer, start, k, v, ids, wait_aged)
                if staging is None:
                    r.keys = k.tobytes()
                    r.values = v.tobytes()
                else:
                    values_at = staging.put(at, k)
                    r.staged.staging_id = staging.id
                    r.staged.keys_offset = at
                    r.staged.values_offset = values_at
                    at = staging.put(values_at, v)
                yield r
        if staging is not None:  # checked before anything is written or sent
            need = sum(k.nbytes + v.nbytes for _, _, k, v, _ in checked)
            if need > staging.size:
                raise KvTierArgumentError(
                    "staging", f"staging area {staging.id} holds {staging.size} bytes, "
                    f"fewer than these appends' {need} bytes of K and V")
        return _within(self.stub.AppendKV, requests(), self.timeout, self._metadata,
                       "AppendKV").num_tokens

    def _append_through_channel(self, session_id, items, wait_aged,
                                layer_bytes: int) -> int | None:
        """append_layers' items (`layer_bytes` of K and V each) through this client's channel,
        in order, the first error raised; None when the channel cannot carry them (a daemon
        without its appends, a channel that broke, a layer larger than its request area: the
        caller streams them instead, and a rewrite of what was applied is a no-op)."""
        with self._append_channel_lock:
            try:
                if self._append_channel is None:
                    self._append_channel = self.open_channel()
                ch = self._append_channel
            except KvTierError:
                self._append_channel_ok = False  # no channels here: the stream from now on
                return None
        if layer_bytes + _CHANNEL_APPEND_OVERHEAD > ch._req_cap:
            return None  # larger steps than this channel's area: this one streams
        stored = 0
        try:
            for layer, at, k, v in items:
                stored = ch.append(session_id, layer, at, k, v, wait_aged=wait_aged)
        except KvTierError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT and e.message.startswith("op: "):
                self._append_channel_ok = False  # a daemon older than the channel's appends
            elif e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.DEADLINE_EXCEEDED) and f"channel {ch.id}" in e.message:
                pass  # the channel broke (the daemon restarted, a call timed out)
            else:
                raise
            with self._append_channel_lock:
                if self._append_channel is ch:
                    self._append_channel = None
            ch.close()
            return None
        return stored

    def append_layers(self, session_id: str, start: int, keys: np.ndarray,
                      values: np.ndarray, wait_aged: bool = False,
                      zero_copy: bool | None = None, channel: bool | None = None) -> int:
        """keys/values [layers][kv_heads][n][head_dim]: every layer's tokens from `start`.
        `channel` (default: on a Unix socket, for at most 64 tokens, a decode loop's step):
        layer by layer through this client's own Select channel (opened at the first such
        append and kept), each layer a call of microseconds rather than one gRPC stream for
        all; a daemon without the channel's appends, or a channel that broke, gets the stream
        instead. `zero_copy` (default: on a Unix socket), for the stream: through the session's
        staging area, which this client opens (and grows) as needed and keeps while the session
        lasts here; a daemon without staging gets the bytes instead, and so does one that lost
        the area (a restart, a session restored from the remote tier), which gets a new area
        next time."""
        keys, values = _as_array("keys", keys), _as_array("values", values)
        items = _layer_items(start, keys, values)
        if channel is None:
            channel = (self.address.startswith("unix:") and self._append_channel_ok
                       and keys.shape[2] <= _CHANNEL_APPEND_TOKENS)
        if channel:
            stored = self._append_through_channel(session_id, items(), wait_aged,
                                                  keys[0].nbytes + values[0].nbytes)
            if stored is not None:
                return stored
        if zero_copy is None:
            zero_copy = self.address.startswith("unix:") and self._staging_ok
        if not zero_copy:
            return self.append_kv(session_id, items(), wait_aged)
        need = keys.nbytes + values.nbytes
        with self._staging_lock:  # one writer of a session's area at a time
            area = self._staging.get(session_id)
            try:
                if area is None or area.size < need:
                    try:
                        area = self._staging[session_id] = self.open_staging(session_id, need)
                    except KvTierError as e:
                        # An area this large refused (past --max_staging_size, the room the
                        # sessions' areas leave, the session's old one counted until this one
                        # replaces it), or the descriptor socket out of reach: this call sends
                        # the bytes, and a later, smaller one may stage again.
                        if e.code not in (grpc.StatusCode.INVALID_ARGUMENT,
                                          grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          grpc.StatusCode.UNAVAILABLE):
                            raise
                        area = None
                if area is not None:
                    return self.append_kv(session_id, items(), wait_aged, staging=area)
            except KvTierError as e:
                if e.code == grpc.StatusCode.FAILED_PRECONDITION and "OpenStaging" in e.message:
                    self._staging_ok = False  # this daemon has none: bytes from now on
                elif e.code == grpc.StatusCode.NOT_FOUND and "staging area" in e.message:
                    # The daemon's session lost it (moved to the remote tier and back, or a
                    # restart): this time the bytes (what was applied is rewritten as a
                    # no-op), the next time a new area.
                    self._staging.pop(session_id, None)
                else:
                    raise
        return self.append_kv(session_id, items(), wait_aged)

    def select(self, session_id: str, layer: int, query: np.ndarray, budget_tokens: int = 0,
               placement: str | None = None, include_data: bool = False, lease_ms: int = 0,
               include_summaries: bool = False, row_handles: bool = True,
               release_lease_ids: Sequence[str] = ()) -> pb.SelectResponse:
        """query fp32 [num_q_heads][head_dim]; returns handles per KV head and a lease.
        `row_handles`: refined rows come as their chunks' handles with a row list, read in
        place by `gather` (False: gathered by the daemon into compact blocks of their own).
        `release_lease_ids`: leases (a decode loop's previous step's, of this layer) ended in
        the same call, before the Select is served; each must be live (else NOT_FOUND, and
        nothing ends and nothing is selected)."""
        # Checked before anything is sent (the Attach stream included).
        req = _select_request(session_id, layer, query, budget_tokens, placement, include_data,
                              lease_ms, include_summaries, row_handles,
                              release_lease_ids=release_lease_ids)
        for attempt in range(2):
            req.worker_id = self.worker_id()
            worker = req.worker_id
            try:
                return self._unary("Select", req)
            except KvTierError as e:
                # The daemon lost the worker (it restarted; the stream just ended): once more.
                if not (worker and attempt == 0 and e.code == grpc.StatusCode.NOT_FOUND
                        and "worker_id" in e.message):
                    raise

    def batch_select(self, requests: Sequence[pb.SelectRequest]) -> pb.BatchSelectResponse:
        """Several Selects in one call (all or nothing: one refused ends the leases the others
        got), e.g. every layer's for the next step with this step's queries (look-ahead). A
        request naming no worker_id gets this client's, as `select` does."""
        batch = _batch(requests)
        worker = self.worker_id()
        for r in batch.requests:
            if not r.worker_id:
                r.worker_id = worker
        return self._unary("BatchSelect", batch)

    def gather(self, head: pb.HeadSelection, session_id: str | None = None, head_dim=None):
        """(positions int64 [n], K [n][d], V [n][d]) of the rows one HeadSelection selected,
        in handle order (a handle's `rows`, when it lists some, else all of its rows), read
        through shared memory (inline bytes when the response carried them)."""
        if head_dim is None:
            if session_id is None:
                raise KvTierArgumentError("session_id", "gather needs session_id or head_dim")
            head_dim = self._shape(session_id).head_dim
        blocks = head.blocks
        total = sum(len(b.rows) or b.num_tokens for b in blocks)
        # A bf16 session's rows are bf16 bits, given back as uint16, as append takes them.
        dt = np.uint16 if any(b.precision == pb.PRECISION_BF16 for b in blocks) else np.float16
        keys = np.empty((total, head_dim), dt)
        values = np.empty((total, head_dim), dt)
        at, i = 0, 0
        while i < len(blocks):
            j = i
            while j < len(blocks) and not blocks[j].keys:
                j += 1
            if j > i:  # a run of handles over shared memory: read together
                k, v = self.segments.gather(blocks[i:j], head_dim, dt)
                keys[at:at + len(k)] = k
                values[at:at + len(v)] = v
                at += len(k)
                i = j
                continue
            b = blocks[i]  # the bytes came inline
            n = b.num_tokens
            if len(b.keys) != 2 * n * head_dim or len(b.values) != len(b.keys):
                raise KvTierArgumentError(
                    "head_dim", f"{head_dim} does not fit chunk {b.chunk_id}'s inline bytes "
                    f"({len(b.keys)} of keys for {n} tokens)")
            k = np.frombuffer(b.keys, dt).reshape(n, head_dim)
            v = np.frombuffer(b.values, dt).reshape(n, head_dim)
            rows = _picked(b)
            if rows is not None:
                k, v = k[rows], v[rows]
            keys[at:at + len(k)] = k
            values[at:at + len(v)] = v
            at += len(k)
            i += 1
        return SegmentMap.positions(blocks), keys, values

    def view(self, handle: pb.BlockHandle, head_dim: int, like: str = "numpy"):
        """Zero-copy (K, V) of one handle over the daemon's shared memory, every row of its
        chunk (a handle's `rows`, when it lists some, are the ones selected): read-only numpy
        arrays, or torch tensors with like="torch"; both export DLPack. On a GPU device tier,
        device arrays (like="torch", "cupy" or "cuda": SegmentMap.view). Call
        `segments.check(handle)` after reading, as gather does."""
        return self.segments.view(handle, head_dim, like=like)

    def release(self, lease_id: str) -> None:
        """Ends a lease: its handles may be reused from now on. NOT_FOUND once it ended."""
        self._unary("Release", _msg(pb.ReleaseRequest, lease_id=lease_id))

    def read_chunks(self, session_id: str, chunk_ids: Sequence[int]) -> list[pb.BlockHandle]:
        """Handles of the named chunks (ListChunks' chunk_id), each read once, in order."""
        stream = _call(self.stub.ReadChunks, _read_chunks_request(session_id, chunk_ids),
                       timeout=self.timeout, metadata=self._metadata)
        return _call(list, stream)

    def fork_session(self, session_id: str, num_tokens: int = 0,
                     new_session_id: str = "") -> SessionHandle:
        """A new session sharing the first `num_tokens` (0: all) of this one's."""
        r = self._unary("ForkSession", _fork_request(session_id, num_tokens, new_session_id))
        return SessionHandle(r.session_id, r.policy)

    def move_session(self, session_id: str, to: "Client", new_session_id: str = "",
                     carrier: str = "parts") -> SessionHandle:
        """A copy of the session moved to the daemon `to` talks to (prefill here, decode
        there): ExportSession's parts relayed into ImportSession there one at a time, as
        `new_session_id` (empty: the same id). The session here stays until closed. The first
        failure on either side ends both calls and is raised; nothing is imported then.
        `carrier`: how the chunks' bytes go, "parts" (through this client), "nccl" (GPU to GPU,
        daemon to daemon; both daemons on CUDA devices) or "socket" (daemon to daemon on one
        host); with the last two only sizes and checksums pass through here. The timeout (the
        shorter of the two clients') bounds the wait for each part, not the whole move, whose
        length grows with the session: DEADLINE_EXCEEDED when nothing moved for that long."""
        req = _msg(pb.ExportSessionRequest, session_id=session_id,
                   carrier=_carrier(carrier))
        timeout = _move_timeout(self.timeout, to.timeout)
        # No deadline on either call: the watch below bounds each part's wait instead.
        parts = self.stub.ExportSession(req, metadata=self._metadata)
        failed: list[grpc.RpcError] = []
        last = [time.monotonic()]  # when a part last moved
        stalled = [False]

        def requests() -> Iterator[pb.ImportSessionRequest]:
            name = new_session_id
            try:
                for p in parts:
                    last[0] = time.monotonic()
                    yield pb.ImportSessionRequest(part=p.part, session_id=name)
                    last[0] = time.monotonic()  # gRPC took it and asks for the next
                    name = ""
            except grpc.RpcError as e:  # the export failed: the import must not complete
                if stalled[0]:
                    return  # cancelled here (the import is cancelled too)
                failed.append(e)
                raise

        call = to.stub.ImportSession.future(requests(), metadata=to._metadata)
        try:
            while True:
                wait = None if timeout is None else last[0] + timeout - time.monotonic()
                try:
                    r = call.result(timeout=None if wait is None else max(wait, 0))
                    break
                except grpc.FutureTimeoutError:
                    if time.monotonic() - last[0] < timeout:
                        continue  # a part moved meanwhile
                    # Stalled: both calls cancelled; a write into a connection whose peer
                    # stopped reading is left to gRPC (it ends when the peer reads again).
                    stalled[0] = True
                    cancelled = call.cancel()  # first: the import must not see its end
                    parts.cancel()
                    if not cancelled and call.done():
                        continue  # it ended just now: its outcome stands
                    raise KvTierError(grpc.StatusCode.DEADLINE_EXCEEDED, _stalled(
                        session_id, timeout)) from None
        except grpc.RpcError as e:
            parts.cancel()
            cause = failed[0] if failed else e
            raise KvTierError(cause.code(), cause.details() or "") from None
        except BaseException:  # an interrupt: neither call goes on
            parts.cancel()
            call.cancel()
            raise
        return SessionHandle(r.session_id, r.policy)

    def close_session(self, session_id: str) -> bool:
        """Closes a session; False when there was none (idempotent)."""
        self._shapes.pop(session_id, None)
        with self._staging_lock:
            self._staging.pop(session_id, None)
        req = _msg(pb.CloseSessionRequest, session_id=session_id)
        return self._unary("CloseSession", req).existed

    # Admin ------------------------------------------------------------------------------

    def list_sessions(self) -> list[pb.SessionInfo]:
        """This tenant's sessions (an admin's: every tenant's)."""
        return list(self._unary("ListSessions", pb.ListSessionsRequest()).sessions)

    def describe_session(self, session_id: str) -> pb.DescribeSessionResponse:
        """One session: shape, policy, usage, and statistics per layer."""
        return self._unary("DescribeSession",
                           _msg(pb.DescribeSessionRequest, session_id=session_id))

    def list_chunks(self, session_id: str, layer: int | None = None,
                    limit: int = 0) -> pb.ListChunksResponse:
        """A session's chunks (one layer's when named): positions, precision, bytes."""
        return self._unary("ListChunks", _list_chunks_request(session_id, layer, limit))

    def tier_stats(self) -> list[pb.TierStats]:
        """Capacity, use, pins, promotions, evictions and copy caches, per tier."""
        return list(self._unary("GetTierStats", pb.GetTierStatsRequest()).tiers)

    def open_segments(self, segment_ids: list[int]) -> list[tuple[pb.Segment, int]]:
        """Read-only descriptors of this tenant's segments `segment_ids` (empty: all), from the
        daemon's descriptor socket (this client's socket path + ".fds", never a path the daemon
        names) with the ticket of an OpenSegments call; the caller closes them."""
        if not self.address.startswith("unix:"):
            raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                              "OpenSegments: descriptors are handed over the Unix socket only")
        resp = self._unary("OpenSegments", _msg(pb.OpenSegmentsRequest, segment_ids=segment_ids))
        want = len(resp.segments)
        named = [seg.segment_id for seg in resp.segments]
        if (segment_ids and named != list(segment_ids)) or want > 4096:
            raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"OpenSegments: the daemon named {want} segments, not the "
                              f"{len(segment_ids)} asked for")
        fds = self._collect_fds(resp.ticket, want)
        return list(zip(resp.segments, fds))

    def _collect_fds(self, ticket: str, want: int) -> list[int]:
        """The `want` descriptors of an OpenSegments or OpenStaging ticket, from this client's
        socket path + ".fds"; none kept on an error."""
        fds: list[int] = []
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5.0)
                sock.connect(self.address[len("unix:"):] + ".fds")
                sock.sendall(ticket.encode() + b"\n")
                while len(fds) < want:
                    text, got, flags, _ = socket.recv_fds(sock, 512, 253)
                    fds.extend(got)
                    for fd in got:  # recv_fds takes no MSG_CMSG_CLOEXEC: a child never has them
                        os.set_inheritable(fd, False)
                    if text == b"k" and not got:  # so that the loop ends
                        raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                          "descriptor socket: a message without descriptors")
                    if not text:
                        raise KvTierError(grpc.StatusCode.UNAVAILABLE,
                                          "descriptor socket: closed")
                    if text != b"k":  # b"b...": busy (the uid's connections at the limit)
                        raise KvTierError(grpc.StatusCode.UNAVAILABLE if text[:1] == b"b"
                                          else grpc.StatusCode.PERMISSION_DENIED,
                                          "descriptor socket: " + text[1:].decode(errors="replace"))
            if len(fds) != want:
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"descriptor socket: {len(fds)} descriptors for {want} asked for")
        except OSError as e:
            for fd in fds:
                os.close(fd)
            raise KvTierError(grpc.StatusCode.UNAVAILABLE, f"descriptor socket: {e}") from None
        except KvTierError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def open_staging(self, session_id: str, size_bytes: int) -> Staging:
        """A staging area of the session's (OpenStaging), mapped read-write here: K and V
        written into it and named by append_kv(..., staging=...) never pass through gRPC. It
        replaces the session's previous area. Unix socket only."""
        if not self.address.startswith("unix:"):
            raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                              "OpenStaging: staging areas are handed over the Unix socket only")
        resp = self._unary("OpenStaging", _msg(pb.OpenStagingRequest, session_id=session_id,
                                                                size_bytes=size_bytes))
        fd = self._collect_fds(resp.ticket, 1)[0]
        try:
            size = os.fstat(fd).st_size
            if size < resp.size_bytes or size <= 0:
                raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"staging area {resp.staging_id}: size_bytes "
                                  f"{resp.size_bytes} but its memory holds {size} bytes")
            buf = mmap.mmap(fd, size)  # read-write, shared
        finally:
            os.close(fd)
        return Staging(resp.staging_id, buf)

    def open_channel(self, size_bytes: int = 0) -> SelectChannel:
        """A shared-memory Select channel (OpenChannel) for this thread's decode loop. Unix
        socket only."""
        if not self.address.startswith("unix:"):
            raise KvTierError(grpc.StatusCode.FAILED_PRECONDITION,
                              "OpenChannel: channels are handed over the Unix socket only")
        resp = self._unary("OpenChannel", _msg(pb.OpenChannelRequest, size_bytes=size_bytes))
        fds = self._collect_fds(resp.ticket, 4)
        return SelectChannel(resp.channel_id, resp.worker_id, fds, self.timeout)

    def list_segments(self) -> list[pb.Segment]:
        """This tenant's shared-memory segments (an admin's: all)."""
        return list(self._unary("ListSegments", pb.ListSegmentsRequest()).segments)

    def list_leases(self, session_id: str = "", limit: int = 0) -> pb.ListLeasesResponse:
        """Live leases: this tenant's (an admin's: every tenant's), of one session when named."""
        return self._unary("ListLeases",
                           _msg(pb.ListLeasesRequest, session_id=session_id, limit=limit))

    def evict(self, session_id: str, tier: str) -> int:
        """Moves a session off "device" (to host) or "host" (to the remote tier); bytes moved."""
        return self._unary("Evict", _evict_request(session_id, tier)).bytes_moved

    def set_policy(self, session_id: str, **policy) -> pb.SessionPolicy:
        """Changes SessionPolicy fields (the chunks that age from now on follow them)."""
        return self._unary("SetPolicy", _set_policy_request(session_id, policy)).policy

    def drain(self) -> int:
        """An admin's: the daemon stops taking calls and exits; the sessions live then."""
        return self._unary("Drain", pb.DrainRequest()).sessions

    def health(self) -> bool:
        """grpc.health.v1 Check of the whole server: True when SERVING."""
        return _call(_health_check(self._channel), b"", timeout=self.timeout) == _SERVING
