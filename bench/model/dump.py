#!/usr/bin/env python3
"""Dumps SmolLM2-135M's post-RoPE Q, K and V of chosen layers to .npz, for studying selection
offline without rerunning the model (the cluster index's ranking comparison reads these).

The text is prefilled with full attention over --context tokens. For each layer L in
--layers the file holds:
  q{L}: float32 [len(positions)][num_heads][head_dim]   queries at the chosen positions
  k{L}, v{L}: float16 [num_kv_heads][context][head_dim]  every key and value of the context
and `positions` (int64), `token_ids`, `layers`, plus the shape (num_heads, num_kv_heads,
head_dim, rope_theta). A query at position p may attend over keys [0, p].

usage: bench/model/dump.py --context 4096 --layers 2,8,15,22,29 --positions 3584:4096:8 \
         --out bench/out/qkv.npz
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from llama import Model  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"


def parse_positions(spec: str, context: int) -> np.ndarray:
    """"a:b:step" (a range), or a comma list; negatives count from the end of the context."""
    if ":" in spec:
        parts = [int(x) if x else None for x in spec.split(":")]
        pos = np.arange(context)[slice(*parts)]
    else:
        pos = np.array([int(x) for x in spec.split(",") if x])
        pos = np.where(pos < 0, pos + context, pos)
    if len(pos) == 0 or pos.min() < 0 or pos.max() >= context:
        raise SystemExit(f"--positions {spec!r} selects nothing inside [0, {context})")
    return pos.astype(np.int64)


def dump(model: Model, ids, context: int, layers, positions) -> dict:
    ids = np.asarray(ids[:context])
    out = {}

    def hook(layer, q, k, v):
        if layer in layers:
            out[f"q{layer}"] = q[positions]
            out[f"k{layer}"] = k.transpose(1, 0, 2).copy()
            out[f"v{layer}"] = v.transpose(1, 0, 2).copy()

    model.prefill(ids, want_logits=False, hook=hook)
    c = model.config
    out.update(positions=positions, token_ids=ids, layers=np.asarray(sorted(layers)),
               num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
               rope_theta=c.rope_theta)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", default="2,8,15,22,29")
    ap.add_argument("--positions", default="-512::8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    model = Model()
    ids = model.tokenizer.encode(Path(a.text).read_text())
    if len(ids) < a.context:
        raise SystemExit(f"--context {a.context}: the text has only {len(ids)} tokens")
    layers = {int(x) for x in a.layers.split(",") if x}
    bad = [x for x in layers if not 0 <= x < model.config.num_layers]
    if bad:
        raise SystemExit(f"--layers {bad} outside [0, {model.config.num_layers})")
    data = dump(model, ids, a.context, layers, parse_positions(a.positions, a.context))
    np.savez_compressed(a.out, **data)
    print(f"wrote {a.out}: layers {sorted(layers)}, {len(data['positions'])} query positions, "
          f"{a.context} keys", file=sys.stderr)


if __name__ == "__main__":
    main()
