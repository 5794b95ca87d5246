"""EngineConfig: one set of defaults for the engine, the commands' flags and
the serving plan; every refused field named; the shapes it fixes."""

import pytest

from gdnx.cli import build_parser
from gdnx.config import ModelConfig
from gdnx.errors import FieldError
from gdnx.inference import speculation
from gdnx.serving import EngineConfig
from tests.helpers.configs import TINY_HYBRID


@pytest.mark.parametrize("field,value,match", [
    ("max_slots", 0, "max_slots: expected an integer >= 1, got 0"),
    ("max_slots", 10 ** 9, "max_slots: expected at most 65,536 requests decoded together, got 1,000,000,000"),
    ("max_length", 1, "max_length: expected an integer >= 2"),
    ("prefix_cache_bytes", -1, "prefix_cache_bytes: expected an integer >= 0"),
    ("draft_method", "eagle", "draft_method: expected one of ngram, mtp, got 'eagle'"),
    ("decode_steps", True, "decode_steps: expected an integer >= 1, got True"),
    ("max_logprobs", 2.5, "max_logprobs: expected an integer >= 0"),
    ("draft_tokens", -2, "draft_tokens: expected an integer >= 0"),
    ("block_size", 0, "block_size: expected None or an integer >= 1"),
    ("max_prefill_batch", 9, r"max_prefill_batch: expected an integer in \[1, max_slots=8\], got 9"),
    ("batch_invariant", 1, "batch_invariant: expected a bool"),
    ("seed", "0", "seed: expected an integer"),
])
def test_each_refused_field_is_named(field, value, match):
    with pytest.raises(FieldError, match=match) as e:
        EngineConfig(**{field: value})
    assert e.value.field == field


def test_the_commands_flags_default_to_the_config():
    default = EngineConfig()
    for argv in (["serve", "--checkpoint", "x"], ["generate", "--checkpoint", "x", "--prompts-file", "p"],
                 ["plan", "tiny", "--topology", "v5e:2x2", "--serve"]):
        args = build_parser().parse_args(argv)
        assert (args.max_slots, args.speculative, args.max_prefill_batch) == (
            default.max_slots, str(default.draft_tokens), default.max_prefill_batch), argv
        assert speculation(args.speculative, ModelConfig(**TINY_HYBRID)) == {
            "draft_method": default.draft_method, "draft_tokens": default.draft_tokens}
        if hasattr(args, "decode_steps"):
            assert args.decode_steps == default.decode_steps


def test_the_shapes_it_fixes():
    cfg = ModelConfig(gdn_chunk_size=16)
    s = EngineConfig(max_slots=6, max_length=100, block_size=32, max_prefill_batch=3, draft_tokens=2).shapes(cfg)
    assert s.block_size == 32 and s.padded_length == 128 and s.capacity == 128 + 2 + 1
    assert s.buckets == (16, 32, 64, 128) and s.decode_rows == (1, 4, 6) and s.prefill_batches == (1, 3)
    assert [s.prefill_batch(n) for n in (1, 2, 3)] == [1, 3, 3]
    wide = EngineConfig(max_slots=64, max_prefill_batch=20).shapes(cfg)
    assert wide.decode_rows == (1, 4, 16, 64) and wide.prefill_batches == (1, 4, 16, 20)
    one = EngineConfig(max_slots=6, max_length=100, batch_invariant=True, max_prefill_batch=3).shapes(cfg)
    assert one.decode_rows == (6,) and one.prefill_batches == (3,) and one.block_size == 64
    with pytest.raises(FieldError, match="block_size: expected a multiple of the model's gdn_chunk_size 16, got 24"):
        EngineConfig(block_size=24).shapes(cfg)


@pytest.mark.parametrize("value,fields", [
    ("0", {"draft_method": "ngram", "draft_tokens": 0}), ("3", {"draft_method": "ngram", "draft_tokens": 3}),
    ("ngram:2", {"draft_method": "ngram", "draft_tokens": 2}), ("mtp", {"draft_method": "mtp", "draft_tokens": 1}),
    ("mtp:3", {"draft_method": "mtp", "draft_tokens": 3}),
])
def test_speculative_values_as_engine_fields(value, fields):
    """--speculative: K or ngram:K (n-gram), mtp (one draft per MTP layer) or mtp:K (chained)."""
    assert speculation(value, ModelConfig(**TINY_HYBRID, mtp_num_layers=1)) == fields
    EngineConfig(**fields)
