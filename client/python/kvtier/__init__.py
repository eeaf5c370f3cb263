"""Python client for kvtierd.

    import numpy as np, kvtier
    c = kvtier.Client("unix:/tmp/kvtier.sock")
    sid = c.create_session(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64).session_id
    c.append_layers(sid, start=0, keys=K, values=V)         # fp16 [layers][kv_heads][n][64]
    sel = c.select(sid, layer=12, query=q, budget_tokens=256)  # q fp32 [9][64]
    for head in sel.heads:
        positions, k, v = c.gather(head)                     # read in place from shared memory
    c.release(sel.lease_id)

The stubs in kvtier.v1 are generated from proto/ by `make venv`.
"""
from kvtier.client import Client, KvTierError, SegmentMap, SelectChannel, Staging

__all__ = ["Client", "KvTierError", "SegmentMap", "SelectChannel", "Staging"]
