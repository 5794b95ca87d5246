"""Generation: prefill the prompt with the chunked op (which returns the conv
and recurrent states), then decode one token at a time with the recurrent op
and the conv update. Greedy, temperature and top-p sampling."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from gdnx.models.cache import Cache
from gdnx.models.causal_lm import CausalLM
from gdnx.parallel.rules import constrain
from gdnx.errors import FieldError
from gdnx.serving.sampling import truncated


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_p: float = 1.0) -> jax.Array:
    """Next tokens [B] from logits [B, vocab]: argmax when temperature is 0,
    else a draw from softmax(logits / temperature) restricted to the smallest
    set of tokens whose probability reaches top_p."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:  # the engine's filter (gdnx.serving.sampling), top_p alone
        rows = logits.shape[0]
        logits = truncated(logits, jnp.zeros(rows, jnp.int32), jnp.full(rows, top_p, jnp.float32),
                           jnp.zeros(rows, jnp.float32))
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill_bytes(model: CausalLM, prompt_length: int, cache_length: int, batch: int = 1) -> int:
    """Bytes the prompt's pass holds beyond the cache and the weights, at
    its peak: an attention layer's float32 scores and probabilities over
    the prompt and the cache [B, heads, T, S], or the layers' activations."""
    cfg = model.config
    attention = 2 * 4 * batch * cfg.num_attention_heads * prompt_length * cache_length
    has_attention = bool({"full_attention", "sliding_attention"} & set(cfg.resolved_layer_types))
    activations = 4 * 4 * batch * prompt_length * max(cfg.hidden_size, cfg.intermediate_size)
    return (attention if has_attention else 0) + activations


def check_sampling(temperature: float, top_p: float, max_new_tokens: int) -> None:
    if not temperature >= 0.0:
        raise FieldError("temperature", f"expected >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise FieldError("top_p", f"expected a value in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise FieldError("max_new_tokens", f"expected >= 1, got {max_new_tokens}")


def generate(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, stop_token: int | None = None,
             on_token: Callable[[jax.Array], None] | None = None) -> jax.Array:
    """prompt int [B, T] -> new tokens int32 [B, <= max_new_tokens]. on_token
    is called with each step's tokens [B] as they come (streaming); a row
    that emits stop_token stops the loop when every row has."""
    check_sampling(temperature, top_p, max_new_tokens)
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt: expected token ids [B, T] with T >= 1, got shape {prompt.shape}")
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, cache):
        model = nnx.merge(graphdef, state)
        out = model.hidden_states(tokens, cache)
        # only the last position's logits (a long prompt's [T, vocab] would not fit); on a
        # context-split mesh that position lives on one shard: gather the length first
        last = constrain(out.hidden, ("batch", None, "hidden"))[:, -1:]
        return model.logits(last)[:, 0], out.cache

    cache = Cache.init(model, prompt.shape[0], prompt.shape[1] + max_new_tokens)
    logits, cache = step(state, prompt, cache)
    key = jax.random.key(seed)
    out, done = [], jnp.zeros(prompt.shape[0], bool)
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok = sample(logits, sub, temperature=temperature, top_p=top_p)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if stop_token is not None:
            done = done | (tok == stop_token)
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits, cache = step(state, tok[:, None], cache)
    return jnp.stack(out, axis=1)
