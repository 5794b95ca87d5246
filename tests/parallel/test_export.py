"""The sharded train step (GDN Pallas TPU kernel, not interpreted) lowers
for TPU through jax.export, on a data x fsdp x tensor mesh and on a context
mesh, in both shard modes: Mosaic lowers the kernels at their per-shard
shapes inside shard_map, and the step serializes for 8 devices. (XLA's
partitioning and compilation for TPU happen on a TPU host, not here.)"""

import warnings

import jax
import jax.numpy as jnp
import pytest

from gdnx.config.reading import load_config
from gdnx.training import Trainer
from tests.helpers.tiers import fast_only
from tests.parallel.helpers import mesh
from tests.parallel.helpers import MODEL


@pytest.mark.parametrize("mode", fast_only(["auto", "explicit"], lambda mode: mode == "auto"))
@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=2, context=4)],
                         ids=["data2_fsdp2_tensor2", "data2_context4"])
def test_sharded_train_step_exports_for_tpu(mode, axes):
    cfg = load_config("tiny", MODEL + ["model.gdn_implementation=pallas_tpu", "model.gdn_interpret=false",
                                       "data.seq_len=64", "data.num_pairs=8", "train.batch_size=8"])
    m = mesh(mode, **axes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "kernel on CPU": here it is compiled for TPU, not run
        trainer = Trainer(cfg, mesh=m, platform="tpu")
    params = trainer.params
    opt_state = trainer.init_opt_state(params)
    with trainer.on_mesh():
        exported = jax.export.export(trainer.step_fn, platforms=["tpu"])(params, opt_state, jnp.int32(0), None)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text, "the GDN kernel is not in the TPU program"
    assert exported.nr_devices == 8
