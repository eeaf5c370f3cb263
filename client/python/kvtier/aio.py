"""kvtier.aio.Client: the calls of kvtier.Client for asyncio code, over grpc.aio.

    import asyncio, numpy as np, kvtier.aio
    async def main():
        async with kvtier.aio.Client("unix:/tmp/kvtier.sock") as c:
            sid = (await c.create_session(30, 9, 3, 64)).session_id
            await c.append_layers(sid, 0, K, V)              # fp16 [layers][kv_heads][n][64]
            sel = await c.select(sid, 12, q, budget_tokens=256)
            positions, k, v = await c.gather(sel.heads[0], sid)
            await c.release(sel.lease_id)
    asyncio.run(main())

It sends the bytes (no zero-copy staging) and does not attach: a lease ends at Release or at
its TTL. What hands over descriptors (open_segments, open_staging, open_channel) is
kvtier.Client's only. Reading handles' bytes maps the daemon's segments through a
kvtier.Client of the same address and credentials, made on first use. Mistakes in arguments
raise KvTierArgumentError before anything is sent; refused calls raise KvTierError, as
kvtier.Client does."""
from __future__ import annotations

import asyncio
from typing import Iterable, Sequence

import grpc
import numpy as np

from kvtier import client as _sync
from kvtier.client import KvTierError, SessionHandle, _carrier, _msg
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


class Client:
    """An asyncio connection to kvtierd ("unix:PATH" or "HOST:PORT"); arguments as
    kvtier.Client's."""

    def __init__(self, address: str = "unix:/tmp/kvtier.sock", tenant: str | None = None,
                 timeout: float = 60.0, max_message_bytes: int = 64 << 20,
                 token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None):
        _sync._check_client_args(address, timeout, max_message_bytes)
        self.address = address
        self.timeout = timeout
        self._metadata = _sync._metadata(tenant, token)
        creds, options = _sync._channel_setup(tls_ca, tls_cert, tls_key, max_message_bytes)
        self._channel = (grpc.aio.secure_channel(address, creds, options=options) if creds
                         else grpc.aio.insecure_channel(address, options=options))
        self.stub = pb_grpc.KvTierStub(self._channel)
        self._sync_args = dict(tenant=tenant, timeout=timeout, token=token, tls_ca=tls_ca,
                               tls_cert=tls_cert, tls_key=tls_key, attach=False)
        self._reader: _sync.Client | None = None
        self._shapes: dict[str, pb.ModelShape] = {}

    async def close(self) -> None:
        """Closes the channel (and the reader of handles' bytes, when one was made)."""
        await self._channel.close()
        if self._reader is not None:
            self._reader.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, name: str, request):
        try:
            return await getattr(self.stub, name)(request, timeout=self.timeout,
                                                  metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise KvTierError(e.code(), e.details() or "") from None

    async def create_session(self, num_layers: int, num_q_heads: int, num_kv_heads: int,
                             head_dim: int, dtype: str = "fp16", session_id: str = "",
                             model_id: str = "", labels: dict[str, str] | None = None,
                             **policy) -> SessionHandle:
        """`policy` takes SessionPolicy fields (sink_tokens=16, recent_window=64, ...)."""
        req = _sync._create_session_request(num_layers, num_q_heads, num_kv_heads, head_dim,
                                            dtype, session_id, model_id, labels, policy)
        r = await self._unary("CreateSession", req)
        self._shapes[r.session_id] = req.shape
        return SessionHandle(r.session_id, r.policy)

    async def append_kv(self, session_id: str,
                        items: Iterable[tuple[int, int, np.ndarray, np.ndarray]],
                        wait_aged: bool = False) -> int:
        """Streams (layer, start_token, keys, values[, token_ids]) as kvtier.Client.append_kv
        does, every item checked first; returns the tokens now stored in every layer."""
        checked = _sync._checked_items(items)

        async def requests():
            for layer, start, k, v, ids in checked:
                r = _sync._append_request(session_id, layer, start, k, v, ids, wait_aged)
                r.keys = k.tobytes()
                r.values = v.tobytes()
                yield r
        call = self.stub.AppendKV(requests(), timeout=self.timeout, metadata=self._metadata)
        try:
            # A second past the deadline: a call whose daemon stopped reading never ends by
            # its deadline (a write into its connection ends only when it reads).
            r = await asyncio.wait_for(call, None if self.timeout is None
                                       else self.timeout + 1)
        except asyncio.TimeoutError:
            call.cancel()
            raise _sync._not_ended("AppendKV", self.timeout) from None
        except grpc.aio.AioRpcError as e:
            raise KvTierError(e.code(), e.details() or "") from None
        return r.num_tokens

    async def append_layers(self, session_id: str, start: int, keys: np.ndarray,
                            values: np.ndarray, wait_aged: bool = False) -> int:
        """keys/values [layers][kv_heads][n][head_dim]: every layer's tokens from `start`."""
        keys, values = _sync._as_array("keys", keys), _sync._as_array("values", values)
        return await self.append_kv(session_id, _sync._layer_items(start, keys, values)(),
                                    wait_aged)

    async def select(self, session_id: str, layer: int, query: np.ndarray,
                     budget_tokens: int = 0, placement: str | None = None,
                     include_data: bool = False, lease_ms: int = 0,
                     include_summaries: bool = False, row_handles: bool = True,
                     release_lease_ids: Sequence[str] = ()) -> pb.SelectResponse:
        """query fp32 [num_q_heads][head_dim]; returns handles per KV head and a lease
        (`release_lease_ids` end in the same call, as kvtier.Client.select says)."""
        return await self._unary("Select", _sync._select_request(
            session_id, layer, query, budget_tokens, placement, include_data, lease_ms,
            include_summaries, row_handles, release_lease_ids=release_lease_ids))

    async def batch_select(self, requests: Sequence[pb.SelectRequest]) -> pb.BatchSelectResponse:
        """Several Selects in one call, all or nothing, as kvtier.Client.batch_select."""
        return await self._unary("BatchSelect", _sync._batch(requests))

    async def release(self, lease_id: str) -> None:
        """Ends a lease: its handles may be reused from now on."""
        await self._unary("Release", _msg(pb.ReleaseRequest, lease_id=lease_id))

    async def _mapped(self, session_id: str) -> tuple["_sync.Client", int]:
        """The client that maps segments, and the session's head_dim."""
        if session_id not in self._shapes:
            self._shapes[session_id] = (await self.describe_session(session_id)).info.shape
        if self._reader is None:
            self._reader = _sync.Client(self.address, **self._sync_args)
        return self._reader, self._shapes[session_id].head_dim

    async def gather(self, head: pb.HeadSelection, session_id: str):
        """(positions, K, V) of one HeadSelection's rows, as kvtier.Client.gather. Read here
        when its segments are mapped already (memory alone); else in a thread, since mapping
        asks the daemon (blocking calls), and the event loop goes on meanwhile."""
        reader, head_dim = await self._mapped(session_id)
        if reader.segments.holds(b.segment_id for b in head.blocks if not b.keys):
            return reader.gather(head, head_dim=head_dim)
        return await asyncio.to_thread(reader.gather, head, head_dim=head_dim)

    async def view(self, handle: pb.BlockHandle, session_id: str, like: str = "numpy"):
        """Zero-copy (K, V) of one handle, numpy or torch, as kvtier.Client.view (in a thread
        when its segment is not mapped yet, as gather)."""
        reader, head_dim = await self._mapped(session_id)
        if reader.segments.holds([handle.segment_id]):
            return reader.view(handle, head_dim, like=like)
        return await asyncio.to_thread(reader.view, handle, head_dim, like=like)

    async def move_session(self, session_id: str, to: "Client",
                           new_session_id: str = "", carrier: str = "parts") -> SessionHandle:
        """As the blocking client's move_session: a copy of the session on the daemon `to`
        talks to, the parts relayed one at a time; the first failure on either side ends both
        calls and is raised. An import the other daemon refuses while parts are still on their
        way (a session too large for it, say) may be raised as INTERNAL "Internal error from
        Core" rather than with the daemon's code: grpc.aio's known bug (grpc/grpc#36066), which
        the blocking client does not have. Nothing is imported either way. `carrier` as the
        blocking client's ("parts", "nccl", "socket"). The timeout (the shorter of the two
        clients') bounds the wait for each part, not the whole move: DEADLINE_EXCEEDED when
        nothing moved for that long."""
        req = _msg(pb.ExportSessionRequest, session_id=session_id, carrier=_carrier(carrier))
        timeout = _sync._move_timeout(self.timeout, to.timeout)
        loop = asyncio.get_running_loop()
        # No deadline on either call: `watch` bounds each part's wait instead.
        parts = self.stub.ExportSession(req, metadata=self._metadata)
        failed: list[grpc.aio.AioRpcError] = []
        last = [loop.time()]  # when a part last moved
        stalled = False

        async def requests():
            name = new_session_id
            try:
                async for p in parts:
                    last[0] = loop.time()
                    yield pb.ImportSessionRequest(part=p.part, session_id=name)
                    last[0] = loop.time()  # gRPC took it and asks for the next
                    name = ""
            except grpc.aio.AioRpcError as e:  # the export failed: the import must not complete
                if stalled:
                    return  # cancelled here (the import is cancelled too)
                failed.append(e)
                raise

        call = to.stub.ImportSession(requests(), metadata=to._metadata)

        async def watch():
            nonlocal stalled
            while (wait := last[0] + timeout - loop.time()) > 0:
                await asyncio.sleep(wait)
            # Stalled: both calls cancelled (a write into a connection whose peer stopped
            # reading is left to gRPC: it ends when the peer reads again).
            stalled = True
            parts.cancel()
            call.cancel()

        watcher = asyncio.create_task(watch()) if timeout is not None else None
        try:
            r = await call
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            task = asyncio.current_task()  # its own cancellation is not a stall (3.11+ says)
            if stalled and not (task is not None and getattr(task, "cancelling", lambda: 0)()):
                raise KvTierError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  _sync._stalled(session_id, timeout)) from None
            # grpc.aio cancels the import when the requests fail: the export's error is the cause.
            if not failed and not isinstance(e, grpc.aio.AioRpcError):
                raise  # this task itself was cancelled
            parts.cancel()
            cause = failed[0] if failed else e
            raise KvTierError(cause.code(), cause.details() or "") from None
        finally:
            if watcher is not None:
                watcher.cancel()
        return SessionHandle(r.session_id, r.policy)

    async def close_session(self, session_id: str) -> bool:
        """Closes a session; False when there was none (idempotent)."""
        self._shapes.pop(session_id, None)
        return (await self._unary("CloseSession",
                                  _msg(pb.CloseSessionRequest, session_id=session_id))).existed

    async def list_sessions(self) -> list[pb.SessionInfo]:
        """This tenant's sessions (an admin's: every tenant's)."""
        return list((await self._unary("ListSessions", pb.ListSessionsRequest())).sessions)

    async def describe_session(self, session_id: str) -> pb.DescribeSessionResponse:
        """One session: shape, policy, usage, and statistics per layer."""
        return await self._unary("DescribeSession",
                                 _msg(pb.DescribeSessionRequest, session_id=session_id))

    async def list_leases(self, session_id: str = "", limit: int = 0) -> pb.ListLeasesResponse:
        """Live leases: this tenant's (an admin's: every tenant's), of one session when named."""
        return await self._unary("ListLeases",
                                 _msg(pb.ListLeasesRequest, session_id=session_id, limit=limit))

    async def fork_session(self, session_id: str, num_tokens: int = 0,
                           new_session_id: str = "") -> SessionHandle:
        """A new session sharing the first `num_tokens` (0: all) of this one's."""
        r = await self._unary("ForkSession",
                              _sync._fork_request(session_id, num_tokens, new_session_id))
        return SessionHandle(r.session_id, r.policy)

    async def read_chunks(self, session_id: str, chunk_ids: Sequence[int]) -> list[pb.BlockHandle]:
        """Handles of the named chunks (ListChunks' chunk_id), each read once, in order."""
        req = _sync._read_chunks_request(session_id, chunk_ids)
        try:
            return [h async for h in self.stub.ReadChunks(req, timeout=self.timeout,
                                                          metadata=self._metadata)]
        except grpc.aio.AioRpcError as e:
            raise KvTierError(e.code(), e.details() or "") from None

    async def list_chunks(self, session_id: str, layer: int | None = None,
                          limit: int = 0) -> pb.ListChunksResponse:
        """A session's chunks (one layer's when named): positions, precision, bytes."""
        return await self._unary("ListChunks",
                                 _sync._list_chunks_request(session_id, layer, limit))

    async def set_policy(self, session_id: str, **policy) -> pb.SessionPolicy:
        """Changes SessionPolicy fields (the chunks that age from now on follow them)."""
        resp = await self._unary("SetPolicy", _sync._set_policy_request(session_id, policy))
        return resp.policy

    async def tier_stats(self) -> list[pb.TierStats]:
        """Capacity, use, pins, promotions, evictions and copy caches, per tier."""
        return list((await self._unary("GetTierStats", pb.GetTierStatsRequest())).tiers)

    async def list_segments(self) -> list[pb.Segment]:
        """This tenant's shared-memory segments (an admin's: all)."""
        return list((await self._unary("ListSegments", pb.ListSegmentsRequest())).segments)

    async def evict(self, session_id: str, tier: str) -> int:
        """Moves a session off "device" (to host) or "host" (to the remote tier); bytes moved."""
        return (await self._unary("Evict", _sync._evict_request(session_id, tier))).bytes_moved

    async def drain(self) -> int:
        """An admin's: the daemon stops taking calls and exits; the sessions live then."""
        return (await self._unary("Drain", pb.DrainRequest())).sessions

    async def health(self) -> bool:
        """grpc.health.v1 Check of the whole server: True when SERVING."""
        try:
            return await _sync._health_check(self._channel)(b"", timeout=self.timeout) == \
                _sync._SERVING
        except grpc.aio.AioRpcError as e:
            raise KvTierError(e.code(), e.details() or "") from None
