"""The model on its own: cache consistency, remat policies, the GDN kernel
switch, input errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.config import ModelConfig, load_config
from gdnx.measure import relative_error
from gdnx.models import Cache, CausalLM
from gdnx.models.causal_lm import parameter_count
from tests.helpers.configs import KIMI, LARA, LING, MOE, TINY_HYBRID
from tests.helpers.models import unrolled_view
from tests.helpers.tiers import fast_only

TINY = {**TINY_HYBRID, **MOE}


def _model(**kw):
    return CausalLM(ModelConfig(**{**TINY, **kw}), seed=1)


def _tokens(b, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, TINY["vocab_size"], (b, t)), jnp.int32)


FAMILIES = {
    "qwen3_next_moe": {},
    "qwen3_5_gva3": dict(family="qwen3_5", num_experts=0, linear_num_value_heads=6),
    "qwen3_5_moe_gva4": dict(family="qwen3_5", linear_num_value_heads=8),
    "olmo_hybrid": dict(family="olmo_hybrid", num_experts=0, head_dim=8, partial_rotary_factor=1.0,
                        linear_allow_neg_eigval=True),
    "olmo_hybrid_nope": dict(family="olmo_hybrid", num_experts=0, head_dim=8, rope_theta=None),
    # KDA (2 heads), latent attention, the grouped sigmoid router (1 of 2 groups)
    "kimi_linear": KIMI,
    "bailing_hybrid": LING,
    "lara_mini": LARA,
}


@pytest.mark.parametrize("family", fast_only(FAMILIES, lambda f: f in ("qwen3_5_gva3", "olmo_hybrid_nope")))
def test_prefill_then_decode_equals_one_pass(family):
    """Prefill 21 tokens into a cache, decode 6 one by one: the logits equal
    a single pass over all 27 (fp32; 1e-5 relative: the chunked and the
    token-by-token GDN paths sum in different orders, ~1e-7 per layer)."""
    model = _model(**FAMILIES[family])
    toks = _tokens(2, 27)
    full = model(toks)
    cache = Cache.init(model, 2, 32)
    out = model.forward(toks[:, :21], cache)
    steps = [out.logits]
    cache = out.cache
    for t in range(21, 27):
        out = model.forward(toks[:, t:t + 1], cache)
        cache = out.cache
        steps.append(out.logits)
    assert int(cache.length) == 27
    assert relative_error(jnp.concatenate(steps, axis=1), full) <= 1e-5


def _grads(model, toks):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        out = nnx.merge(graphdef, p).forward(toks)
        return jnp.mean(out.logits ** 2) + out.aux_loss
    return jax.tree.leaves(jax.jit(jax.grad(loss))(params))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("policy", ["full", "save_gdn_residuals"])
def test_remat_policies_keep_gradients(policy, scan):
    """Remat per decoder layer, inside the scan when the layers are scanned
    (the same parameter tree either way with scan: compared scanned to
    scanned)."""
    toks = _tokens(2, 40)
    ref = _grads(_model(scan_layers=scan), toks)
    got = _grads(_model(remat_policy=policy, scan_layers=scan), toks)
    # each gradient leaf within 1e-5 relative: remat recomputes the same
    # float32 forward, so only XLA's fusion choices can move the last bits
    for a, b in zip(got, ref):
        assert relative_error(a, b) <= 1e-5


def test_kernel_on_and_off_agree_in_a_train_step():
    """The tiny model of configs/tiny.yml with gdn_implementation=pallas_tpu
    (interpret mode on CPU) and xla: every parameter gradient
    agrees to 1e-5 relative (fp32)."""
    cfg = load_config("tiny").model
    toks = _tokens(2, 40)
    with pytest.warns(UserWarning, match="interpret mode"):
        on = CausalLM(cfg.model_copy(update={"gdn_implementation": "pallas_tpu"}), seed=1)
    off = CausalLM(cfg.model_copy(update={"gdn_implementation": "xla"}), seed=1)
    assert on.layers[0].mixer.op.implementation == "pallas_tpu"
    assert off.layers[0].mixer.op.implementation == "xla"
    g_on, g_off = _grads(on, toks), _grads(off, toks)
    for a, b in zip(g_on, g_off):
        assert relative_error(a, b) <= 1e-5


def test_auto_picks_no_kernel_on_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _model(gdn_implementation="auto")
    assert model.layers[0].mixer.op.implementation is None  # the op's default: xla on CPU


@pytest.mark.slow
def test_tied_embeddings_and_bf16():
    model = _model(tie_word_embeddings=True, dtype="bfloat16")
    assert model.lm_head is None
    logits = model(_tokens(1, 9))
    assert logits.dtype == jnp.float32 and logits.shape == (1, 9, TINY["vocab_size"])
    assert bool(jnp.isfinite(logits).all())


def test_token_errors():
    model = _model()
    with pytest.raises(TypeError, match=r"tokens: expected integer token ids \[B, T\]"):
        model(jnp.zeros((2, 3), jnp.float32))
    with pytest.raises(TypeError, match=r"tokens"):
        model(jnp.zeros((3,), jnp.int32))


@pytest.mark.slow
def test_published_config_builds_the_80b_model():
    """The bundled qwen3-next-80b-a3b config, built abstractly (no memory):
    79.67 billion parameters, the published 80B without the multi-token
    prediction head."""
    model = nnx.eval_shape(lambda: CausalLM(load_config("qwen3-next-80b-a3b").model))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == 79_674_391_296
    # 48 layers scanned: 12 repeats of 3 GDN + 1 attention, nothing left over
    assert model.config.scanned and model.config.layer_cycle == 4 and not model.tail
    assert [layer.layer_type for layer in model.cycle] == ["linear_attention"] * 3 + ["full_attention"]
    assert model.cycle[0].mixer.A_log.shape == (12, 32)


# bundled config -> (parameters gdnx builds, the published size in billions,
# the relative distance allowed): the published checkpoints also hold a
# multi-token prediction layer and (Qwen3.5) a vision encoder, which the
# language model leaves out; OLMo Hybrid's "7B" is a nominal size.
PUBLISHED = {
    # the 0.8B's language model with its multi-token prediction layer (the checkpoint's 0.85B adds vision)
    "qwen3.5-0.8b": (772_845_888, 0.8, 0.04),
    "qwen3.5-27b": (26_895_998_464, 27, 0.01),
    "qwen3.5-397b-a17b": (396_346_350_336, 397, 0.01),
    "olmo-hybrid-7b": (7_430_870_688, 7, 0.07),
    # Kimi Linear's "48B" counts its language model at 49.12B (transformers agrees: test_causal_lm_hf)
    "kimi-linear-48b-a3b": (49_122_681_728, 48, 0.03),
}


@pytest.mark.parametrize("name", fast_only(PUBLISHED, lambda n: n in ("kimi-linear-48b-a3b", "olmo-hybrid-7b")))
def test_bundled_family_configs_build_the_published_sizes(name):
    count, billions, margin = PUBLISHED[name]
    model = nnx.eval_shape(lambda: CausalLM(load_config(name).model))
    built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert built == count
    assert abs(built / 1e9 - billions) <= margin * billions, built


@pytest.mark.parametrize("family,implementation", fast_only(
    [(f, i) for f in ("qwen3_next_moe", "olmo_hybrid", "kimi_linear") for i in ("xla", "pallas_tpu")],
    lambda case: case in (("olmo_hybrid", "pallas_tpu"), ("kimi_linear", "xla"))))
def test_packed_documents_match_each_document_alone(implementation, family):
    """Three documents (7, 20 and 13 tokens) packed in one row after others:
    each one's logits equal those of the document alone (float32, relative
    1e-5), through GDN or KDA, attention (latent attention) and MoE layers,
    with the XLA path and the Pallas TPU kernel (interpret mode)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernel on CPU warns that it interprets
        model = _model(**FAMILIES[family], gdn_implementation=implementation)
    lengths = [7, 20, 13]
    docs = [_tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    row = jnp.concatenate(docs, axis=1)
    segments = jnp.concatenate([jnp.full((1, n), i, jnp.int32) for i, n in enumerate(lengths)], axis=1)
    # jitted: the interpreted kernel's callbacks deadlock against eager ops
    forward = nnx.jit(lambda m, tokens, segments: m.forward(tokens, segments=segments).logits)
    alone = nnx.jit(lambda m, tokens: m(tokens))
    packed = forward(model, jnp.concatenate([row, row[:, ::-1]]), jnp.concatenate([segments] * 2))
    offset = 0
    for doc, n in zip(docs, lengths):
        assert relative_error(packed[0, offset:offset + n], alone(model, doc)[0]) <= 1e-5
        offset += n
    # the second row: the reversed tokens cut at the same boundaries
    assert relative_error(packed[1, :7], alone(model, row[:, ::-1][:, :7])[0]) <= 1e-5
    assert relative_error(packed[1, 7:27], alone(model, row[:, ::-1][:, 7:27])[0]) <= 1e-5


# 6 layers: a dense GDN layer first (the head), two repeats of (GDN MoE,
# attention MoE), then one GDN MoE layer left over (the tail)
SCANNED = dict(num_hidden_layers=6, layer_types=["linear_attention"]
               + ["linear_attention", "full_attention"] * 2 + ["linear_attention"],
               mlp_only_layers=[0])


# GDN, gated attention and MoE; KDA and latent attention's stacked caches (every family's scanned logits
# are checked against transformers in tests/models/test_causal_lm_hf.py)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next_moe", "kimi_linear"])
def test_scanned_layers_equal_the_unrolled_stack(family):
    """The scanned model starts from the unrolled model's parameters (bit for
    bit, stacked), and gives its logits, load-balancing loss and prefill +
    decode logits within 1e-6 relative (float32: the same operations,
    another program), its gradients within 2e-6 (the weight gradients are
    float32 sums over every token, whose order each program's fusion picks:
    1.1e-6 measured for qwen3_next_moe; each leaf within 1e-5 of its scale,
    below)."""
    kw = {**FAMILIES[family], **SCANNED}
    unrolled, scanned = _model(**kw, scan_layers=False), _model(**kw, scan_layers=True)
    cfg = scanned.config
    assert cfg.scanned and not unrolled.config.scanned
    assert (len(scanned.head), cfg.layer_cycle, cfg.cycle_repeats, len(scanned.tail)) == (1, 2, 2, 1)
    ref, got = unrolled_view(unrolled), unrolled_view(scanned)
    assert set(got) == set(ref)
    for path in ref:
        np.testing.assert_array_equal(got[path], ref[path], err_msg=str(path))
    toks = _tokens(2, 40)
    run = nnx.jit(lambda m, t: m.forward(t))
    a, b = run(unrolled, toks), run(scanned, toks)
    assert relative_error(b.logits, a.logits) <= 1e-6
    assert abs(float(b.aux_loss) - float(a.aux_loss)) <= 1e-6 * abs(float(a.aux_loss))

    def grads(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            out = nnx.merge(graphdef, p).forward(toks)
            return jnp.mean(out.logits ** 2) + out.aux_loss
        g = nnx.merge(graphdef, jax.jit(jax.grad(loss))(params))
        return unrolled_view(g)
    ref_grads, got_grads = grads(unrolled), grads(scanned)
    flat = [jnp.concatenate([g[path].ravel() for path in ref_grads]) for g in (got_grads, ref_grads)]
    assert relative_error(*flat) <= 2e-6
    # Each leaf within 1e-5 of its own norm or of the whole gradient's root-mean-square entry times the
    # leaf's root size, whichever is larger: a leaf's rounding comes from the float32 sums that make it,
    # whose terms are at the scale of the cotangents through the whole model, so a leaf that is the small
    # remainder of terms that cancel (A_log's and dt_bias's, ~1e-6 against entries of ~1e-3) carries
    # rounding at that scale, not at its own.
    rms = float(jnp.linalg.norm(flat[1])) / flat[1].size ** 0.5
    for path in ref_grads:
        leaf = ref_grads[path]
        scale = max(float(jnp.linalg.norm(leaf)), rms * leaf.size ** 0.5)
        assert float(jnp.linalg.norm(got_grads[path] - leaf)) <= 1e-5 * scale, path

    def decode(model):
        cache = Cache.init(model, 2, 32)
        out = run_cached(model, toks[:, :21], cache)
        steps = [out.logits]
        for t in range(21, 25):
            out = run_cached(model, toks[:, t:t + 1], out.cache)
            steps.append(out.logits)
        return jnp.concatenate(steps, axis=1)
    run_cached = nnx.jit(lambda m, t, c: m.forward(t, c))
    assert relative_error(decode(scanned), decode(unrolled)) <= 1e-6


def test_layer_cycle_and_when_the_stack_is_scanned():
    cycle = lambda **kw: ModelConfig(**{**TINY, **kw}).layer_cycle  # noqa: E731
    assert cycle(num_hidden_layers=48, full_attention_interval=4) == 4
    # 3 GDN layers as 3 repeats of one, the attention and 2 GDN layers after
    # them unrolled: 4 layers in the program, against 6 (or 4 + 2 left over)
    assert cycle(num_hidden_layers=6, full_attention_interval=4) == 1
    assert cycle(num_hidden_layers=8, full_attention_interval=4, decoder_sparse_step=2) == 4
    # no block of kinds follows itself: one cycle of the whole depth
    never = dict(num_hidden_layers=8, layer_types=[
        "linear_attention", "full_attention", *["linear_attention"] * 3, "full_attention", "linear_attention",
        "full_attention"], mlp_only_layers=[2, 4])
    assert cycle(**never) == 8
    # a dense first layer, then two repeats of 3 GDN + attention: a head of one
    cfg = ModelConfig(**{**TINY, "num_hidden_layers": 9, "full_attention_interval": 4, "mlp_only_layers": [0]})
    assert (cfg.layer_head, cfg.layer_cycle, cfg.cycle_repeats) == (1, 4, 2)
    scanned = lambda **kw: ModelConfig(**{**TINY, **kw}).scanned  # noqa: E731
    assert not scanned(num_hidden_layers=4) and scanned(num_hidden_layers=8)  # unset: by depth
    assert scanned(num_hidden_layers=4, scan_layers=True) and not scanned(num_hidden_layers=8, scan_layers=False)
    assert not scanned(**never)  # unset, one cycle: nothing to gain
    assert scanned(**never, scan_layers=True)  # a scan of one repeat


@pytest.mark.parametrize("name,overrides", [
    ("tiny", []),
    ("base", ["model.num_hidden_layers=8", "model.hidden_size=64", "model.intermediate_size=32",
              "model.moe_intermediate_size=16", "model.shared_expert_intermediate_size=16", "model.vocab_size=300",
              "model.num_experts=4", "model.num_experts_per_tok=2", "model.mlp_only_layers=[1,5]",
              "model.decoder_sparse_step=2", "model.num_attention_heads=2", "model.num_key_value_heads=1",
              "model.linear_num_value_heads=4", "model.linear_num_key_heads=2"]),
    ("olmo-hybrid-7b", ["model.num_hidden_layers=6"]),
])
def test_the_parameter_count_is_the_built_models(name, overrides):
    """Counted from one layer of each kind (mixer; MoE or dense, by
    mlp_only_layers and decoder_sparse_step): equal to the full model's."""
    cfg = load_config(name, overrides).model
    built = jax.eval_shape(lambda: nnx.state(CausalLM(cfg), nnx.Param))
    assert parameter_count(cfg) == sum(x.size for x in jax.tree.leaves(built))


@pytest.mark.parametrize("family", fast_only(["qwen3_next", "kimi_linear", "lara_mini"], lambda f: f == "qwen3_next"))
def test_padded_rows_and_state_histories_for_serving(family):
    """A cache with a length per row: right-padded rows (lengths) give each
    row's logits and next states as the row alone (a sliding window's ring
    too), and history_every keeps the GDN (KDA) states after every block,
    equal to a prefill stopped there (float32, 1e-5: the same algebra in
    other shapes)."""
    model = _model(**{**FAMILIES.get(family, {}), "num_experts": 0})
    toks = _tokens(2, 32, seed=4)
    lengths = jnp.asarray([13, 32], jnp.int32)
    padded = nnx.jit(lambda m, t, c, n: m.hidden_states(t, c, lengths=n, history_every=16))
    forward = nnx.jit(lambda m, t: m.forward(t, Cache.init(m, 1, 48)))
    out = padded(model, toks, Cache.init(model, 2, 48, per_row=True), lengths)
    logits = model.logits(out.hidden)
    np.testing.assert_array_equal(out.cache.length, [13, 32])
    # row 0 alone; row 1's first 16 tokens and all 32 (itself alone, and its history's second entry)
    alone = {(0, 13): forward(model, toks[:1, :13]), (1, 16): forward(model, toks[1:, :16]),
             (1, 32): forward(model, toks[1:, :32])}
    for row, n in ((0, 13), (1, 32)):
        assert relative_error(logits[row, n - 1], alone[row, n].logits[0, -1]) < 1e-5
        for mine, theirs in zip(out.cache.layers, alone[row, n].cache.layers):
            if hasattr(mine, "recurrent"):
                assert relative_error(mine.recurrent[row], theirs.recurrent[0]) < 1e-5
                assert relative_error(mine.conv[row], theirs.conv[0]) < 1e-6
            if hasattr(mine, "ring"):  # a sliding window's ring: the row's last real keys, not its padding
                assert relative_error(mine.k[row], theirs.k[0]) < 1e-5
    # the history: after tokens 16 and 32 of the full row
    for j, end in enumerate((16, 32)):
        for mine, theirs in zip(out.cache.layers, alone[1, end].cache.layers):
            if hasattr(mine, "recurrent"):
                assert relative_error(mine.history.recurrent[1, j], theirs.recurrent[0]) < 1e-5
                assert relative_error(mine.history.conv[1, j], theirs.conv[0]) < 1e-5


def test_serving_arguments_need_a_cache_with_a_length_per_row():
    model = _model(num_experts=0)
    with pytest.raises(ValueError, match="lengths, history_every: apply to a cache with a length per row"):
        model.hidden_states(_tokens(1, 16), Cache.init(model, 1, 32), lengths=jnp.asarray([3]))
    with pytest.raises(ValueError, match="history_every: expected 1 or a multiple of the chunk size 16"):
        model.hidden_states(_tokens(1, 16), Cache.init(model, 1, 32, per_row=True), history_every=8)
