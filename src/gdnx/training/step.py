"""The train step: AdamW with warmup + cosine decay and gradient clipping,
the loss and its metrics, gradient accumulation over micro-batches, and
the step function that the loop (gdnx.training.loop) and `gdnx plan` jit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gdnx.config.schema import Config, TrainConfig
from gdnx.data import Batch
from gdnx.loss import blocked_cross_entropy
from gdnx.layers.lora import dropout_key, fold_dropout
from gdnx.models import CausalLM
from gdnx.parallel import constrain
from gdnx.stacking import layer_ndim


def check_trainable(config: Config) -> None:
    """What a train step refuses to train, whether a run or `gdnx plan`
    asks for it (ValueError naming the field)."""
    if config.model.quantize_activations != "none":
        raise ValueError("model.quantize_activations: float8 activations are for inference (serve, generate, eval); "
                         "train with model.quantize_activations=none")
    if config.model.quantize != "none" and config.train.lora is None:
        raise ValueError(f"model.quantize: {config.model.quantize} weights are frozen; train LoRA adapters over them "
                         "(train.lora) or train unquantized (model.quantize=none)")


def make_optimizer(train_cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, train_cfg.learning_rate, train_cfg.warmup_steps, train_cfg.steps,
        end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio)
    # no decay on norms, biases and the per-head decay parameters (1-D in each layer)
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, p: layer_ndim(path, p.ndim) >= 2, params)
    return optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip),
                       optax.adamw(schedule, b1=train_cfg.adam_b1, b2=train_cfg.adam_b2,
                                   weight_decay=train_cfg.weight_decay, mask=decay_mask))


class Totals(NamedTuple):
    """The denominators of a batch's metrics: counted positions, MQAR first
    queries and UTF-8 bytes of the targets. Taken from the whole batch, so
    micro-batches' losses and metrics add up to the whole batch's."""
    tokens: jax.Array
    first_tokens: jax.Array
    text_bytes: jax.Array | None


def batch_totals(batch: Batch) -> Totals:
    """Each at least 1, so that an empty batch divides by 1."""
    def count(x):
        return jnp.maximum(jnp.sum(x), 1).astype(jnp.float32)
    text_bytes = None if batch.target_bytes is None else count(batch.target_bytes * batch.mask)
    return Totals(count(batch.mask), count(batch.first), text_bytes)


def loss_and_metrics(model: CausalLM, batch: Batch, aux_coef: float, totals: Totals | None = None,
                     mtp_weight: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy over the masked positions (+ the MoE balancing loss),
    computed in blocks of positions (gdnx.loss). Metrics: loss and accuracy;
    MQAR adds first-query accuracy, text bits per byte. Sums are divided by
    `totals` (the batch's own by default; a micro-batch gets its whole
    batch's, and aux_coef its share). mtp_weight: the multi-token prediction
    module's loss (`mtp_loss_sums`) added at that weight, the mean over its
    depths."""
    totals = totals or batch_totals(batch)
    out = model.hidden_states(batch.inputs, segments=batch.segments)
    sums = blocked_cross_entropy(out.hidden, model.logits, batch.targets, batch.mask, batch.first,
                                 vocab=model.config.vocab_size)
    loss = sums.nll / totals.tokens
    metrics = {"loss": loss, "accuracy": sums.hits / totals.tokens}
    if totals.text_bytes is None:
        metrics["first_query_accuracy"] = sums.first_hits / totals.first_tokens
    else:
        metrics["bits_per_byte"] = sums.nll / math.log(2.0) / totals.text_bytes
    total = loss + aux_coef * out.aux_loss
    if mtp_weight and model.mtp is not None:
        depths = mtp_loss_sums(model, out.hidden, batch)
        for k, (nll, hits) in enumerate(depths):
            metrics[f"mtp_loss_{k + 1}"] = nll / totals.tokens
            metrics[f"mtp_accuracy_{k + 1}"] = hits / totals.tokens
        total = total + mtp_weight * sum(nll for nll, _ in depths) / totals.tokens / len(depths)
    return total, metrics


def mtp_loss_sums(model: CausalLM, hidden: jax.Array, batch: Batch) -> list[tuple[jax.Array, jax.Array]]:
    """(summed cross-entropy, hits) of each depth k of the multi-token
    prediction module: position t predicts the target of t + k + 1 (token
    t + k + 2) where that target is counted (batch.mask: SFT's completion
    masks hold) and, in a packed row, in t's document. Divided by the main
    loss's token count, as the other sums, so micro-batches add up."""
    out = []
    for k, h in enumerate(model.mtp_hidden(hidden, batch.inputs, batch.segments)):
        t = h.shape[1]
        mask = batch.mask[:, k + 1:]
        if batch.segments is not None:
            mask = mask & (batch.segments[:, k + 1:] == batch.segments[:, :t])
        sums = blocked_cross_entropy(h, model.logits, batch.targets[:, k + 1:], mask, jnp.zeros_like(mask),
                                     vocab=model.config.vocab_size)
        out.append((sums.nll, sums.hits))
    return out


def micro_batches(batch: Batch, count: int) -> Batch:
    """[B, ...] -> [count, B / count, ...]; micro-batch i takes rows i,
    i + count, ..., so each keeps its share of every device's rows when the
    batch axis is sharded."""
    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def accumulated_gradients(loss_fn: Callable[[Any, Any, Any, float], tuple[jax.Array, dict]], params: Any,
                          batch: Any, count: int, totals: Any = None) -> tuple[tuple[jax.Array, dict], Any]:
    """value_and_grad of loss_fn(params, batch, totals, share) over `count`
    micro-batches in a scan, summed (float32 as the parameters): the same
    loss, metrics and gradient as one pass over the whole batch, holding one
    micro-batch's activations. The MoE balancing loss, not a sum over
    tokens, is the mean of the micro-batches' (as Megatron and Hugging Face
    accumulate it). totals: the whole batch's denominators (a Batch's
    batch_totals by default)."""
    totals = batch_totals(batch) if totals is None else totals
    grad = jax.value_and_grad(loss_fn, has_aux=True)
    if count == 1:
        return grad(params, batch, totals, 1.0)

    def body(acc, indexed):
        index, micro = indexed
        with fold_dropout(index):  # each micro-batch draws its own LoRA dropout masks
            out = grad(params, place_batch(micro), totals, 1.0 / count)
        return jax.tree.map(jnp.add, acc, out), None

    values = jax.eval_shape(grad, params, jax.tree.map(lambda x: x[:x.shape[0] // count], batch), totals, 1.0)[0]
    # zeros_like keeps each parameter's sharding (an Explicit mesh types it)
    zeros = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), values), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, (jnp.arange(count), micro_batches(batch, count)))
    return total


def place_batch(batch: Batch) -> Batch:
    return jax.tree.map(lambda x: constrain(x, ("batch", "length")), batch)


def batch_of(source_fn: Callable | None, seed: int, step: jax.Array, batch: Batch | None) -> Batch:
    """The batch of `step`: made in the graph (MQAR) or given (host-read)."""
    if batch is None:
        assert source_fn is not None  # in-graph sources give one
        batch = source_fn(seed)(step)
    return place_batch(batch)


def aux_loss_coef(config: Config) -> float:
    """The MoE balancing loss's weight in the training loss (0 when dense)."""
    return config.model.router_aux_loss_coef if config.model.num_experts else 0.0


def make_step_fn(config: Config, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                 source_fn: Callable | None = None) -> Callable:
    """The train step (params, opt_state, step, batch) -> (params, opt_state,
    metrics), to jit: the batch is given (host-read data) or, when None,
    made in the graph by source_fn (MQAR). Under LoRA (train.lora) the
    params are the adapters, the base weights are given frozen, and each
    step draws the adapters' dropout masks from (seed, step). Gradients over
    train.grad_accum_steps micro-batches; a step whose loss, gradient or
    update is not finite leaves the parameters and optimizer state as they
    were."""
    aux = aux_loss_coef(config)
    lora = config.train.lora
    # under LoRA the module trains only with adapters of its own (train.lora.mtp): frozen, its loss is no use
    mtp = config.train.mtp_loss_weight if config.model.mtp_num_layers and (lora is None or lora.mtp) else 0.0

    def step_fn(params, opt_state, step, batch, frozen=None):
        """frozen: the base weights under LoRA (params are the adapters)."""
        def loss_fn(p, data, totals, share):
            model = nnx.merge(graphdef, p) if frozen is None else nnx.merge(graphdef, p, frozen)
            return loss_and_metrics(model, data, aux * share, totals, mtp)

        key = None
        if lora is not None and lora.dropout:
            key = jax.random.fold_in(jax.random.key(config.train.seed), step)
        with dropout_key(key):
            (loss, metrics), grads = accumulated_gradients(
                loss_fn, params, batch_of(source_fn, config.train.seed, step, batch), config.train.grad_accum_steps)
        return finite_update(tx, params, opt_state, loss, grads, metrics)
    return step_fn


def finite_update(tx: optax.GradientTransformation, params: Any, opt_state: Any, loss: jax.Array, grads: Any,
                  metrics: dict) -> tuple[Any, Any, dict]:
    """The optimizer's step from `grads`, taken only where the loss, the
    gradient and the update are finite: a step that is not leaves the
    parameters and optimizer state as they were. Adds grad_norm and skipped
    (1.0 for a step not taken) to `metrics`."""
    updates, new_opt_state = tx.update(grads, opt_state, params)
    metrics["grad_norm"] = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"]) & jnp.isfinite(optax.tree.norm(updates))
    metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    return keep(optax.apply_updates(params, updates), params), keep(new_opt_state, opt_state), metrics
