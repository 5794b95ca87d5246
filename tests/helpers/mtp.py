"""Checkpoints with a multi-token prediction module (mtp.*), built from a
tiny Hugging Face checkpoint of a family that has one."""

from __future__ import annotations

import json
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file


def mtp_checkpoint(src, dst, rng):
    """src with an MTP module: (directory, the MTP tensors, the full-attention layer it copies)."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    layer = config["layer_types"].index("full_attention")
    tensors = load_file(src / "model.safetensors")
    h = config["hidden_size"]
    mtp = {f"mtp.layers.0.{k.removeprefix(f'model.layers.{layer}.')}":
           (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype)
           for k, v in tensors.items() if k.startswith(f"model.layers.{layer}.")}
    mtp["mtp.fc.weight"] = (0.1 * rng.standard_normal((h, 2 * h))).astype(np.float32)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    save_file({**tensors, **mtp}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return dst, mtp, layer


def progressions(rng, rows: int, length: int, vocab: int) -> np.ndarray:
    """Token rows that count up from a random start by a random step in
    {1, 2, 3} (mod vocab): after two tokens every next one follows, so a
    model learns them in a few hundred steps, and its multi-token
    prediction module the one after."""
    start = rng.integers(0, vocab, (rows, 1))
    step = rng.integers(1, 4, (rows, 1))
    return ((start + step * np.arange(length)[None]) % vocab).astype(np.int32)


def trained_mtp_model(fields: dict, steps: int = 300, seed: int = 0, length: int = 24, rows: int = 16,
                      learning_rate=3e-3):
    """A CausalLM of these config fields with an MTP module, trained with
    gdnx's loss (the module's at weight 1) on `progressions` with Adam (at
    learning_rate: a float or an optax schedule): its drafts are mostly
    accepted."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from gdnx.config import ModelConfig
    from gdnx.data.source import Batch
    from gdnx.models import CausalLM
    from gdnx.training.step import loss_and_metrics

    model = CausalLM(ModelConfig(**{**fields, "mtp_num_layers": 1}), seed=seed)
    graphdef, params = nnx.split(model)
    optimizer = optax.adam(learning_rate)
    opt = optimizer.init(params)

    @jax.jit
    def step(params, opt, tokens):
        batch = Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones_like(tokens[:, 1:], bool),
                      jnp.ones_like(tokens[:, 1:], bool))

        def loss(p):
            return loss_and_metrics(nnx.merge(graphdef, p), batch, 0.0, mtp_weight=1.0)[0]
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = optimizer.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        params, opt, _ = step(params, opt, jnp.asarray(progressions(rng, rows, length + 1, fields["vocab_size"])))
    return nnx.merge(graphdef, params)


def ling_mtp_checkpoint(src, dst, rng):
    """A Ling 3 (bailing_hybrid) checkpoint with its multi-token prediction
    layer as Ling stores it, the layer after the decoder's (model.layers.N:
    enorm, hnorm, eh_proj, shared_head.norm and a full-attention decoder
    layer, copied from the model's last one, perturbed), and the config
    fields transformers' MTP module builds from: (directory, its tensors)."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    last = max(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    tensors = load_file(src / "model.safetensors")
    mtp = {f"model.layers.{n}.{k.removeprefix(f'model.layers.{last}.')}":
           (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype)
           for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = (0.1 * rng.standard_normal((h, 2 * h))).astype(np.float32)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{n}.{name}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    save_file({**tensors, **mtp}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1,
                                                 "mtp_layer_types": ["full_attention"],
                                                 "mtp_mlp_layer_types": [config["mlp_layer_types"][-1]]}))
    return dst, mtp
