"""Python client for kvtierd.

    import numpy as np, kvtier
    c = kvtier.Client("unix:/tmp/kvtier.sock")
    sid = c.create_session(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64).session_id
    c.append_layers(sid, start=0, keys=K, values=V)         # fp16 [layers][kv_heads][n][64]
    sel = c.select(sid, layer=12, query=q, budget_tokens=256)  # q fp32 [9][64]
    for head in sel.heads:
        positions, k, v = c.gather(head, sid)                # copies of the selected rows
    c.release(sel.lease_id)

The stubs in kvtier.v1 are generated from proto/ by `pip install ./client/python` (or, in
the repository, `make venv`). A mistake in a call's arguments raises KvTierArgumentError
(INVALID_ARGUMENT, naming the argument) before anything is sent; a refused call raises
KvTierError with the daemon's code and message.
"""
from kvtier.client import (Client, KvTierArgumentError, KvTierError, SegmentMap, SelectChannel,
                           Staging)

__all__ = ["Client", "KvTierArgumentError", "KvTierError", "SegmentMap", "SelectChannel",
           "Staging"]
