"""`gdnx plan --serve`: the engine's prefill, decode and verify programs
compiled by libtpu for TPU slices that are not attached (deviceless).
Runs in `.venv-aot`, marked `deviceless`."""

import jax
import pytest

from gdnx.config import load_config
from gdnx.models import CausalLM
from gdnx.models.cache import cache_bytes
from gdnx.serving import EngineConfig
from gdnx.serving.plan import serve_plan
from tests.parallel.helpers import FAMILIES, MODEL

pytestmark = [pytest.mark.deviceless, pytest.mark.slow]

# the tiny model with attention and MoE layers, scanned
SMALL = ["model.num_hidden_layers=4", "model.layer_types=null", "model.full_attention_interval=2",
         "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=64",
         "model.shared_expert_intermediate_size=64", "model.scan_layers=true", "model.gdn_chunk_size=64"]
# the tiny model of a family's own paths, unscanned
FAMILY = [*MODEL, "model.gdn_chunk_size=64"]


@pytest.mark.parametrize("topology,axes,speculative,prefill", [
    # the multi-token prediction module drafting: its layer, keys and values counted
    ("v5e:2x2", ["parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2", "model.mtp_num_layers=1"], 2, None),
    ("v5p:2x2x1", ["parallel.data=2", "parallel.tensor=2"], 0, 1),
    # GLM-5-Next (a full-index layer, then a shared one; hyper-connections): its index caches in the slots,
    # decode gathering the selected rows
    ("v6e:2x2", ["parallel.data=2", "parallel.tensor=2", "glm5_next"], 2, None),
    # Qwen4-Exp: its index caches and a PLE layer's states in the slots, the n-gram tables over fsdp x tensor
    ("v5e:2x2", ["parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2", "qwen4_exp"], 2, None),
])
def test_the_engines_programs_compile_for_a_slice(topology, axes, speculative, prefill):
    family = axes[-1] if axes[-1] in FAMILIES else None
    config = load_config("tiny", [*FAMILY, *FAMILIES[family], *axes[:-1]] if family else SMALL + axes)
    mtp = config.model.mtp_num_layers > 0
    engine = EngineConfig(max_slots=4, max_length=256, draft_tokens=speculative, decode_steps=2,
                          max_prefill_batch=prefill, draft_method="mtp" if mtp else "ngram")
    p = serve_plan(config, topology, engine, prefix_cache=prefill is None)  # the second without its snapshots
    assert p.chips == 4 and p.fits
    assert (p.max_prefill_batch, p.prefill_follows_slots) == ((4, True) if prefill is None else (prefill, False))
    assert set(p.temp_bytes) == {"prefill", "decode"} | ({"verify"} if speculative else set())
    assert p.kernel_calls > 0, "the delta rule's Pallas kernel is not in the compiled prefill"
    # the slot caches, counted independently: every chip holds at least its share and at most all of them
    model = jax.eval_shape(lambda: CausalLM(config.model))
    caches = cache_bytes(model, p.capacity, batch=4, rollback=speculative)
    cfg = config.model
    if mtp:  # the drafter's keys and values and a hidden state per slot (float32)
        caches += 4 * 4 * (2 * p.capacity * cfg.num_key_value_heads * cfg.head_dim + cfg.hidden_size)
        assert p.drafter == "mtp"
    assert caches / p.chips <= p.slot_bytes <= caches + 4 * 2 * 4 * config.model.vocab_size + 4096
    assert p.weight_bytes >= 4 * p.parameters / p.chips  # float32 weights, at least a chip's share
    assert p.largest_slots >= 4 and p.decode_flops > 0 and p.xla_flops["decode"] > 0


def test_qwen3_next_80b_serves_on_two_h200s_with_bounded_temporaries():
    """The bundled Qwen3-Next-80B-A3B on two H200s (tensor 2, 32 slots of
    4,096 tokens, 8 prompts prefilled together, 2 drafts): it fits and no
    program's temporaries pass 20 GiB per GPU (the experts' grouped matmuls
    are tokamax's Triton kernels; XLA:GPU's dense ragged_dot would hold 645
    GiB in the prefill)."""
    config = load_config("qwen3-next-80b-a3b", ["parallel.data=1", "parallel.tensor=2"])
    p = serve_plan(config, "h200:2", EngineConfig(max_slots=32, max_length=4096, max_prefill_batch=8,
                                                  draft_tokens=2))
    assert p.chips == 2 and p.hbm_bytes == 141 * 10 ** 9
    assert p.fits and max(p.temp_bytes.values()) <= 20 * 2 ** 30, p.temp_bytes
    assert p.kernel_calls > 0 and set(p.temp_bytes) == {"prefill", "decode", "verify"}


def test_decode_flops_against_xla_on_an_unrolled_model():
    """One decode step of an unrolled dense model: XLA's count of the
    per-chip program (times the chips, tensor parallel) is the
    architecture's count plus what it leaves out (norms, activations,
    sampling over the vocabulary): measured 1.28x at width 256, 8 slots
    of 1,024 tokens; checked within [1, 2]."""
    over = ["model.hidden_size=256", "model.intermediate_size=512", "model.linear_num_key_heads=4",
            "model.linear_num_value_heads=8", "model.linear_key_head_dim=64", "model.linear_value_head_dim=64",
            "model.num_hidden_layers=4", "model.layer_types=null", "model.full_attention_interval=4",
            "model.num_attention_heads=4", "model.head_dim=64", "model.vocab_size=4096", "model.scan_layers=false",
            "parallel.data=1", "parallel.tensor=4"]
    p = serve_plan(load_config("tiny", over), "v5e:2x2", EngineConfig(max_slots=8, max_length=1024, decode_steps=1))
    ratio = p.xla_flops["decode"] * p.chips / p.decode_flops
    assert 1.0 <= ratio <= 2.0, ratio


def test_too_many_slots_do_not_fit():
    """4,096 slots of 8,192 tokens of a 4-layer model with two attention
    layers: their keys and values alone are 4096 x 8192 x 2 x 2 x 4 x 16 x 4
    bytes = 64 GiB over 4 chips, past a v5e chip's 16 GiB."""
    over = ["parallel.data=1", "parallel.tensor=4", "model.num_hidden_layers=4", "model.layer_types=null",
            "model.full_attention_interval=2", "model.max_position_embeddings=8192"]
    try:
        p = serve_plan(load_config("tiny", over), "v5e:2x2",
                       EngineConfig(max_slots=4096, max_length=8192, decode_steps=1))
    except ValueError as e:  # libtpu refuses the program as it compiles
        assert "does NOT fit" in str(e) and "--max-slots" in str(e)
    else:
        assert not p.fits and p.largest_slots < 4096


def test_cli_prints_the_serving_plan_and_refuses_bad_settings_in_one_line(capsys):
    from gdnx.cli import main

    args = ["plan", "tiny", "--topology", "v5e:2x2", "--serve", "--max-slots", "2", "--max-length", "128",
            "parallel.data=1", "parallel.tensor=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "slot state" in out and "fits" in out and "FLOPs per decode step" in out, out
    for bad, match in ((["--max-slots", "0"], "--max-slots: expected an integer >= 1"),
                       (["--max-length", "999999"], "--max-length: 999999 exceeds the model's"),
                       (["--prefix-cache-mb", "-1"], "--prefix-cache-mb: expected a non-negative integer"),
                       (["--max-prefill-batch", "3"], "--max-prefill-batch: expected an integer in [1, --max-slots=2]"),
                       (["parallel.context=2", "parallel.tensor=2"], "parallel.context: the engine splits heads"),
                       (["--topology", "x100:8"], "or N GPUs of one host <gpu>:N (h100, ")):
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err
