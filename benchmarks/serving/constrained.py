"""What a constrained request costs the requests beside it with speculative
decoding on: the engine switches drafts off while any running request is
constrained (its tokens are drawn one per decode call, the host checking
each against the grammar), so the others decode one token per pass too.

    python -m benchmarks.serving.constrained [--repeats 3]

The peer benchmark's checkpoint (benchmarks/serving/server.py --peer: Qwen3.5,
width 256, 8 layers, byte-level BPE of 4,096 entries, random weights), 9
slots of 256 tokens, NgramDrafter(4), prompts that repeat a 16-token
phrase (so n-gram drafts are accepted), 64 tokens each, greedy. Three
runs in one process: 8 plain requests with speculation; the same 8 plus
one request under a JSON schema; the 8 plain requests with speculation
off. Reported: the 8 plain requests' tokens/s, tokens per decode or verify
pass, and that their tokens are the same in all three (median of
--repeats after one that compiles). Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.serving.server import peer_checkpoint

from gdnx.data.text import HFTokenizer  # noqa: E402
from gdnx.models import CausalLM  # noqa: E402
from gdnx.serving import Engine, NgramDrafter, SamplingParams  # noqa: E402
from gdnx.serving.grammar import Grammars  # noqa: E402
from gdnx.serving.params import Structured  # noqa: E402

from benchmarks.harness import machine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}}}


def run(engine: Engine, prompts: list[list[int]], constrained: bool) -> tuple[float, float, list[list[int]]]:
    plain = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    shaped = SamplingParams(max_tokens=64, temperature=0.0, structured=Structured("json", json.dumps(SCHEMA)))
    before = engine.stats.decode_calls + engine.stats.verify_calls
    start = time.perf_counter()
    out = engine.generate(prompts + ([prompts[0]] if constrained else []),
                          [plain] * len(prompts) + ([shaped] if constrained else []))
    seconds = time.perf_counter() - start
    tokens = [c.tokens for c in out[:len(prompts)]]
    passes = engine.stats.decode_calls + engine.stats.verify_calls - before
    return sum(map(len, tokens)) / seconds, sum(map(len, tokens)) / max(passes, 1) / len(prompts), tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"a constrained request beside speculation, {machine()}, `python -m benchmarks.serving.constrained --repeats {args.repeats}`\n")
    with tempfile.TemporaryDirectory() as tmp:
        peer_checkpoint(Path(tmp))
        model = CausalLM.from_pretrained(tmp)
        tok = HFTokenizer(str(Path(tmp) / "tokenizer.json"))
        # the checkpoint has no end-of-sequence token: token 0 ends a constrained output
        grammars = Grammars((Path(tmp) / "tokenizer.json").read_text(), model.config.vocab_size, eos_id=0)
        rng = np.random.default_rng(0)
        prompts = [np.tile(rng.integers(1, 4000, 16), 4).tolist() for _ in range(8)]
        engines = {spec: Engine(model, max_slots=9, max_length=256, tokenizer=tok, grammars=grammars, eos_token_ids=[0],
                                speculative=NgramDrafter(4) if spec else None) for spec in (True, False)}
        cases = [("speculation, 8 plain requests", True, False),
                 ("speculation, the 8 + 1 under a JSON schema", True, True),
                 ("no speculation, 8 plain requests", False, False)]
        rows, tokens = [], []
        for name, spec, constrained in cases:
            got = [run(engines[spec], prompts, constrained) for _ in range(args.repeats + 1)][1:]
            rows.append((name, statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)))
            tokens.append(got[-1][2])
    print("| run | the 8 plain requests' tokens/s | their tokens per program call (decode or verify) | vs the first |")
    print("|---|---:|---:|---:|")
    for name, rate, per_pass in rows:
        print(f"| {name} | {rate:,.0f} | {per_pass:.2f} | {rate / rows[0][1]:.2f}x |")
    print(f"\nthe plain requests' tokens are the same in all three runs: {tokens[0] == tokens[1] == tokens[2]}")


if __name__ == "__main__":
    main()
