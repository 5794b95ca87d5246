"""Tiny random Hugging Face models of every family gdnx builds (torch, CPU)
and the same weights loaded into gdnx, for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from gdnx.measure import relative_error
from gdnx.models import CausalLM

VOCAB = 97
# 4 layers (GDN, attention, GDN, attention), K != V, GQA in attention
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention"] * 2)
_QWEN_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
# Kimi Linear: KDA (2 heads), latent attention (4 heads, K != V, no query
# bottleneck or one of rank 12), group-limited sigmoid routing
_KIMI = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, intermediate_size=48,
             moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, linear_num_heads=2,
             linear_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2, pad_token_id=None,
             bos_token_id=None, eos_token_id=None)
# kind -> (config class, model class, fields): GVA groups 2 (Qwen3-Next, OLMo
# Hybrid), 3 (Qwen3.5 dense) and 4 (Qwen3.5 MoE); OLMo with beta in [0, 2];
# Kimi Linear with its first layer dense and 2 of 4 groups of experts, or
# every layer routed over one group behind a low-rank query
KINDS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(head_dim=16, linear_num_value_heads=4, intermediate_size=48, num_experts=0,
                        rope_parameters=_QWEN_ROPE)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                       dict(head_dim=16, linear_num_value_heads=4, intermediate_size=48, rope_parameters=_QWEN_ROPE,
                            **_MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(head_dim=16, linear_num_value_heads=6, intermediate_size=48, rope_parameters=_QWEN_ROPE)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(head_dim=16, linear_num_value_heads=8, rope_parameters=_QWEN_ROPE, **_MOE)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM",
                    dict(linear_num_value_heads=4, intermediate_size=48, linear_allow_neg_eigval=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=None,
                         eos_token_id=None)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(_KIMI, q_lora_rank=None, n_group=4, topk_group=2,
                         mlp_layer_types=["dense", "sparse", "sparse", "sparse"])),
    "kimi_linear_q_lora": ("KimiLinearConfig", "KimiLinearForCausalLM",
                           dict(_KIMI, q_lora_rank=12, n_shared_experts=2, mlp_layer_types=["sparse"] * 4)),
    # KDA (4 heads of 16) with the bounded gate, latent attention with RoPE, a
    # head gate and a low-rank query, groups of experts, bounded SwiGLUs, one
    # multi-token prediction layer in the config; the rope part narrower than
    # the KDA heads (save_pretrained writes qk_rope_head_dim as config.json's
    # head_dim and the KDA heads' size as linear_head_dim)
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=12, head_dim=16, intermediate_size=48,
                            moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, n_group=4,
                            topk_group=2, layer_group_size=2, first_k_dense_replace=1, num_mtp_layers=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            swiglu_limits=[0, 0.5, 0, 0.7], swiglu_limits_shared=[0, 0.3, 0, 0], pad_token_id=None,
                            bos_token_id=None, eos_token_id=None)),
    # Lara 4 Mini: the period-5 pattern (GDN, sliding, GDN, full, sliding), GVA
    # groups of 2, a window of 6 tokens, every layer routed, tied embeddings
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM",
                  dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=16, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2, sliding_window=6,
                       pad_token_id=None, bos_token_id=None, eos_token_id=None)),
}
# GLM-5-Next: transformers has it as a vision-language model only (a
# one-block vision tower here); a dense first layer, then twice KDA (the
# bounded gate), a full-index attention layer and a shared-index one right
# after it (transformers shares a selection only with the next layer); a
# budget of 8 tokens in pools of 4 (16 index heads: with few, a pool every
# head scores below zero ties at 0, and transformers breaks ties its own
# way); 4 hyper-connection streams; clamped SwiGLUs. Not in KINDS: its
# export carries a vision tower only from a source (vision_from).
GLM5_NEXT_TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=2,
    kv_lora_rank=12, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=6, intermediate_size=48,
    moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, index_n_heads=16,
    index_head_dim=8, index_kpool=4, index_topk=8, linear_num_heads=2, linear_head_dim=8, hc_mult=4,
    hc_sinkhorn_iters=5, swiglu_limit=0.8,
    layer_types=["linear_attention"] + ["linear_attention", "indexed_attention", "indexed_attention"] * 2,
    indexer_types=["full", "full", "full", "shared", "full", "full", "shared"],
    mlp_layer_types=["dense"] + ["sparse"] * 6, pad_token_id=None)
# Qwen4-Exp: transformers has it as a vision-language model only (a
# one-block vision tower here); GDN (sigmoid output gate) and indexed
# attention in turn, per-layer embeddings on both GDN layers (trigrams, 2
# tables per order, primes from 50 on, each table in 4 pieces), a budget of
# 8 tokens in blocks of 4, 4 streams of rank-8 gates, every layer routed.
QWEN4_EXP_TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_value_heads=4,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "indexed_attention"] * 2, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, hc_count=4, hc_lowrank=8,
    ple_layer_ids=[1, 3], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, indexer_n_heads=4, indexer_kv_heads=1,
    indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, output_gate_type="sigmoid",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0]}, eos_token_id=3, pad_token_id=None)
VISION_LANGUAGE_KINDS = {
    "qwen4_exp": ("Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration",
                  dict(text_config=QWEN4_EXP_TEXT, vision_config=dict(
                      depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32))),
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration",
                  dict(text_config=GLM5_NEXT_TEXT, vision_config=dict(
                      depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32,
                      projection_intermediate_size=32))),
}
# the kinds whose configs take _BASE's fields
_BASED = ("qwen3_next", "qwen3_next_moe", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")


def tiny_hf_config(kind: str, **kw):
    config_cls, _, fields = {**KINDS, **VISION_LANGUAGE_KINDS}[kind]
    return getattr(transformers, config_cls)(**{**(_BASE if kind in _BASED else {}), **fields, **kw})


def random_hf_model(kind: str, seed: int = 0, scale: float = 1.0, **kw):
    """HF's own init, plus noise on the parameters it initialises to
    constants (norm weights, dt_bias, routers' correction biases, GLM-5-Next's
    pool gates and biases, Qwen4-Exp's PLE convolutions), so a swapped or skipped one shows."""
    torch.manual_seed(seed)
    model = getattr(transformers, {**KINDS, **VISION_LANGUAGE_KINDS}[kind][1])(tiny_hf_config(kind, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "index_kpool_compress" in name or ".ple.conv1d." in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif scale != 1.0:
                p.mul_(scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    return model


def tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def hf_logits(hf, toks) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(toks)).logits.numpy()


def assert_same_model(back, hf) -> None:
    """back (transformers' load of an export) holds hf's tensors bit for
    bit and gives its logits."""
    src = dict(hf.state_dict())
    assert set(back.state_dict()) == set(src)
    for name, tensor in back.state_dict().items():
        torch.testing.assert_close(tensor, src[name], rtol=0, atol=0, msg=name)
    toks = tokens(1, 20)
    np.testing.assert_array_equal(hf_logits(back, toks), hf_logits(hf, toks))


# A ChatML template as Qwen's checkpoints carry (the roles it knows; a system
# turn only first), over a word-level tokenizer of the tiny models' vocabulary
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLE_WORDS = ("system", "user", "assistant")


def word(i: int) -> str:
    """The word of token id i (ids past the special and role tokens)."""
    return f"w{i}"


def write_chat_tokenizer(directory, vocab: int = VOCAB) -> None:
    """tokenizer.json (word level: the special tokens, the role words, then
    w<i> for the remaining ids, split on whitespace) and tokenizer_config.json
    with CHAT_TEMPLATE, as a Qwen checkpoint's directory holds them."""
    import json

    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    names = [*SPECIAL, *ROLE_WORDS]
    table = {name: i for i, name in enumerate(names)}
    table.update({word(i): i for i in range(len(names), vocab)})
    tok = Tokenizer(WordLevel(vocab=table, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None}))


def sentence(rng, words: int) -> str:
    return " ".join(word(int(i)) for i in rng.integers(len(SPECIAL) + len(ROLE_WORDS), VOCAB, words))


def write_word_tokenizer(directory) -> None:
    """tokenizer.json: word level over the tiny models' vocabulary, w<i> is id i."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(vocab={word(i): i for i in range(VOCAB)}, unk_token=word(0)))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(Path(directory) / "tokenizer.json"))


def words(ids) -> str:
    return " ".join(word(int(i)) for i in ids)


# a byte-level BPE vocabulary (every string can be written) of at most this many entries; its first: <|endoftext|>
BPE_VOCAB = 320
BPE_TEXT = ('{"name": "abc", "ok": true, "n": 12, "items": [1, 2]}', "hello world, the quick brown fox",
            "yes no maybe 123-ab (1+2)")


def write_bpe_tokenizer(directory, size: int = BPE_VOCAB) -> int:
    """tokenizer.json: a byte-level BPE trained on BPE_TEXT (at most `size`
    entries; <|endoftext|> is id 0). Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(BPE_TEXT) * 50, trainer)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(directory) / "tokenizer.json"))
    return tok.get_vocab_size()


class HFCheckpoints:
    """Tiny Hugging Face checkpoints, each built once per test process and
    shared by every test that asks for the same one (the `hf_checkpoints`
    fixture): read-only, a test that changes one copies it first.

    tokenizer: None, "words" (word level, w<i> is id i) or "chat" (word
    level with the special and role tokens and a ChatML template)."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[tuple, tuple[Path, Any]] = {}

    def _build(self, kind: str, seed: int, scale: float, tokenizer: str | None, fields: dict) -> tuple[Path, Any]:
        key = (kind, seed, scale, tokenizer, tuple(sorted(fields.items())))
        if key not in self._built:
            if tokenizer not in (None, "words", "chat"):
                raise ValueError(f"tokenizer: expected None, 'words' or 'chat', got {tokenizer!r}")
            path = self.root / f"{kind}-{len(self._built)}"
            hf = random_hf_model(kind, seed, scale, **fields)
            hf.save_pretrained(path)
            if tokenizer == "words":
                write_word_tokenizer(path)
            elif tokenizer == "chat":
                write_chat_tokenizer(path)
            self._built[key] = (path, hf)
        return self._built[key]

    def path(self, kind: str, *, seed: int = 0, scale: float = 1.0, tokenizer: str | None = None,
             **fields) -> Path:
        """The checkpoint's directory (fields: the HF config's, over KINDS')."""
        return self._build(kind, seed, scale, tokenizer, fields)[0]

    def hf(self, kind: str, *, seed: int = 0, scale: float = 1.0, tokenizer: str | None = None, **fields):
        """The transformers model the checkpoint holds (eval mode; not to be changed)."""
        return self._build(kind, seed, scale, tokenizer, fields)[1]

    def hf_and_gdnx(self, kind: str, *, seed: int = 0, scale: float = 1.0, tokenizer: str | None = None,
                    **overrides):
        """The transformers model and gdnx's CausalLM loaded from its
        checkpoint (overrides: gdnx model config fields)."""
        path, hf = self._build(kind, seed, scale, tokenizer, {})
        return hf, CausalLM.from_pretrained(path, **overrides)


def assert_packed_equals_alone(logits, lengths=(13, 22, 10)) -> None:
    """logits(tokens, segments or None) over a row packing documents of
    these lengths gives each document's logits alone (1e-5): the documents
    alone run in one batch, padded after their ends, which their causal
    logits do not see."""
    docs = [tokens(1, n, seed=10 + n)[0] for n in lengths]
    segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[None]
    packed = np.asarray(logits(np.concatenate(docs)[None].astype(np.int32), segments.astype(np.int32)))[0]
    alone = np.asarray(logits(np.stack([np.pad(d, (0, max(lengths) - len(d))) for d in docs]).astype(np.int32), None))
    at = 0
    for i, n in enumerate(lengths):
        err = relative_error(packed[at:at + n], alone[i, :n])
        assert err <= 1e-5, (i, err)
        at += n


def assert_config_refused(model_type: str, text: dict, edit: dict, named: str) -> None:
    """A vision-language config.json whose text_config is `text` with `edit`
    is refused in one line containing `named`."""
    from gdnx.checkpoints.hf_config import model_config_from_hf

    try:
        model_config_from_hf({"model_type": model_type, "text_config": {**text, **edit}})
    except ValueError as error:
        assert named in str(error) and "\n" not in str(error), str(error)
    else:
        raise AssertionError(f"{edit} was accepted")
