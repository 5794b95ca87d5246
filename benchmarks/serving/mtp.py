"""The multi-token prediction module as the engine's drafter, on this
machine's CPU: acceptance per draft position and tokens/s against plain
decoding at 1, 8 and 32 requests, and what a verify pass costs against a
decode step.

    python -m benchmarks.serving.mtp [--steps 300] [--width 512]

Model: Qwen3-Next's pattern (3 GDN layers, then attention; 8 layers) with
an MTP module, float32, trained here with gdnx's loss (the module's at
weight 1) on counting sequences (a random start, a step of 1-3, mod the
vocabulary) until its first drafts are mostly right. Requests: counting
prompts of 32 tokens, 64 greedy tokens each (ignore_eos). Each timing is
the median of --repeats runs (at least 32 / requests) after an untimed one
that compiles, the engines taking turns in each round; every engine's
tokens are asserted equal to plain decoding's. Prints markdown for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np
import optax


from gdnx.data.source import Batch  # noqa: E402
from gdnx.models import CausalLM  # noqa: E402
from gdnx.models.causal_lm import parameter_count  # noqa: E402
from gdnx.serving import Engine, SamplingParams  # noqa: E402
from gdnx.training.step import loss_and_metrics  # noqa: E402
from tests.helpers.mtp import progressions, trained_mtp_model  # noqa: E402

from benchmarks.harness import machine


def model_fields(width: int) -> dict:
    return dict(vocab_size=1024, hidden_size=width, num_hidden_layers=8, full_attention_interval=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=width // 4, linear_value_head_dim=width // 4,
                intermediate_size=3 * width, num_experts=0, mtp_num_layers=1, gdn_chunk_size=32)


def train(fields: dict, steps: int) -> tuple[CausalLM, float, float, float]:
    """(the trained model, its loss and the MTP module's on fresh sequences, seconds)."""
    start = time.perf_counter()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 20, steps, 2e-4)
    model = trained_mtp_model(fields, steps, length=48, learning_rate=schedule)
    seconds = time.perf_counter() - start
    tokens = jnp.asarray(progressions(np.random.default_rng(99), 16, 49, fields["vocab_size"]))
    batch = Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones_like(tokens[:, 1:], bool), jnp.ones_like(tokens[:, 1:], bool))
    _, metrics = loss_and_metrics(model, batch, 0.0, mtp_weight=1.0)
    return model, float(metrics["loss"]), float(metrics["mtp_loss_1"]), seconds


def interleaved(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams,
                repeats: int) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """Median seconds of generating `prompts` on each warm engine, the
    engines taking turns in each round (the machine's drift falls on all
    alike), and each engine's tokens."""
    tokens = {name: [c.tokens for c in e.generate(prompts, params)] for name, e in engines.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (16 sequences of 48 tokens)")
    parser.add_argument("--width", type=int, default=512, help="hidden size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()

    fields = model_fields(args.width)
    model, loss, mtp_loss, seconds = train(fields, args.steps)
    print(f"The MTP module as the drafter, {machine()}; "
          f"`python -m benchmarks.serving.mtp --steps {args.steps} --width {args.width}`. Model: width "
          f"{args.width}, 8 layers (GDN x3, attention), {parameter_count(model.config) / 1e6:.1f}M parameters with "
          f"the MTP layer, float32; trained {args.steps} steps in {seconds:.0f} s: loss {loss:.3f}, MTP loss "
          f"{mtp_loss:.3f}. Requests: counting prompts of 32 tokens, 64 greedy tokens each.\n")
    print("| requests | decoding | tokens/s | vs plain | acceptance by draft position | tokens per pass "
          "| ms per call |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for n in args.requests:
        prompts = progressions(rng, n, 32, fields["vocab_size"]).tolist()
        settings = dict(max_slots=n, max_length=128, block_size=32, decode_steps=8)
        engines = {"plain": Engine(model, **settings)}
        # every step drafting (draft_rows=n), then the engine's default rule (draft_rows 1 on CPU)
        for k in args.drafts:
            engines[f"mtp:{k}" + (" (draft_rows=n)" if n > 1 else "")] = Engine(
                model, **settings, draft_method="mtp", draft_tokens=k, draft_rows=n)
        if n > 1:
            engines[f"mtp:{args.drafts[-1]}, the default draft_rows"] = Engine(
                model, **settings, draft_method="mtp", draft_tokens=args.drafts[-1])
        repeats = max(args.repeats, 32 // n)
        times, got = interleaved(engines, prompts, params, repeats)
        tokens = n * params.max_tokens
        for name, engine in engines.items():
            assert got[name] == got["plain"], f"{name} at {n} requests changed the tokens"
            s = engine.stats
            calls = (s.verify_calls + s.decode_calls) / (repeats + 1)
            if name == "plain":
                by, per_pass = "-", "-"
            else:
                by = ", ".join(f"{a:.2f}" for a in s.acceptance_at()) or "- (no drafts)"
                per_pass = f"{s.tokens_per_pass:.2f}" if s.verify_calls else "1.00"
            label = f"plain ({settings['decode_steps']} tokens per call)" if name == "plain" else name
            print(f"| {n} | {label} | {tokens / times[name]:,.0f} | {times['plain'] / times[name]:.2f}x | {by} | "
                  f"{per_pass} | {1000 * times[name] / calls:.1f} |")

if __name__ == "__main__":
    main()
