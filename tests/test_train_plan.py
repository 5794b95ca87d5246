"""`gdnx plan`: the sharded train step compiled by libtpu for TPU slices
and by the CUDA plugin for GPU hosts that are not attached (deviceless).
Runs in `.venv-aot` (`make test` installs both there), marked
`deviceless`."""

import pytest

from gdnx.config import load_config
from gdnx.train_plan import plan
from tests.parallel.helpers import FAMILIES, MODEL

pytestmark = pytest.mark.deviceless

# the tiny model with attention and MoE layers, scanned, packed rows of 256
SMALL = ["model.num_hidden_layers=4", "model.layer_types=null", "model.full_attention_interval=2",
         "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=64",
         "model.shared_expert_intermediate_size=64", "model.scan_layers=true", "model.gdn_chunk_size=64",
         "data.seq_len=256", "train.batch_size=8"]


@pytest.mark.slow
@pytest.mark.parametrize("topology,axes", [
    ("v4:2x2x1", ["parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2"]),
    ("v5p:2x2x1", ["parallel.data=2", "parallel.context=2"]),
    ("v6e:2x2", ["parallel.data=-1", "parallel.expert=2", "parallel.shard_mode=explicit"]),
    # GLM-5-Next (unscanned): KDA's kernel, the sparse-attention indexer and the hyper-connections in the step
    ("v5e:2x2", ["parallel.data=2", "parallel.tensor=2", "glm5_next"]),
    # Qwen4-Exp: the gated residuals, QSA, the n-gram tables' rows over fsdp x tensor and their hashing in the step
    ("v6e:2x2", ["parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2", "qwen4_exp"]),
])
def test_train_step_compiles_for_a_slice_with_the_kernel(monkeypatch, topology, axes):
    from gdnx import train_plan

    texts: list[str] = []
    count = train_plan._kernel_calls
    monkeypatch.setattr(train_plan, "_kernel_calls", lambda text: texts.append(text) or count(text))
    family = axes[-1] if axes[-1] in FAMILIES else None
    small = [*MODEL, *FAMILIES[family], "model.gdn_chunk_size=64", *axes[:-1]] if family else SMALL + axes
    p = plan(load_config("tiny", small), topology)
    assert p.chips == 4 and p.fits
    assert p.kernel_calls > 0, "the GDN Pallas kernel is not in the compiled program"
    if p.mesh["expert"] > 1:  # each device's token copies sent alone, not the worst case's padded blocks
        assert "ragged-all-to-all" in texts[0]
    # each chip holds at least its share of the parameters and both AdamW moments (float32)
    assert p.argument_bytes >= 3 * 4 * p.parameters / p.chips
    assert p.flops > 0


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["h100:4"])  # on TPU slices: the expert case of the train step above
def test_the_expert_axis_exchanges_the_token_copies_ragged(monkeypatch, topology):
    """On GPUs, as on TPUs, the expert axis sends each device's token copies
    alone (ragged_all_to_all), not the worst case's padded blocks."""
    from gdnx import train_plan

    texts = []
    monkeypatch.setattr(train_plan, "_kernel_calls", lambda text: texts.append(text) or 1)
    p = plan(load_config("tiny", SMALL + ["parallel.data=1", "parallel.fsdp=2", "parallel.expert=2"]), topology)
    assert p.fits and p.mesh["expert"] == 2
    assert "ragged-all-to-all" in texts[0]


@pytest.mark.slow
def test_qwen3_next_80b_trains_on_a_host_of_eight_h200s():
    """The bundled Qwen3-Next-80B-A3B's train step (8 rows of 4,096 tokens)
    sharded fsdp 8 over the GPUs of one H200 host: the GDN kernels and the
    experts' grouped matmuls are Triton's, and it fits."""
    p = plan(load_config("qwen3-next-80b-a3b", ["parallel.data=1", "parallel.fsdp=8"]), "h200:8")
    assert p.chips == 8 and p.fits and p.kernel_calls > 0
    assert p.argument_bytes >= 3 * 2 * p.parameters / p.chips  # bfloat16 parameters and moments, a share each


@pytest.mark.slow
def test_qwen3_5_0_8b_trains_whole_on_one_v5e_chip():
    """The bundled Qwen3.5-0.8B, fully trained (bfloat16 parameters and
    AdamW moments) on 4,096-token rows on one TPU v5e chip: it fits its
    16 GiB with the Pallas kernels, as benchmarks/device/model.py runs it."""
    p = plan(load_config("qwen3.5-0.8b", ["train.batch_size=1"]), "v5e:1x1")
    assert p.chips == 1 and p.fits and p.kernel_calls > 0
    assert p.argument_bytes >= 3 * 2 * p.parameters  # bfloat16 parameters and both moments


@pytest.mark.slow
def test_model_flops_against_xla_on_an_unrolled_model():
    """Without loops over layers, XLA's count of the per-chip programs
    (summed) is the architecture's count plus the elementwise work it leaves
    out (norms, activations, softmax, the optimizer): measured 1.26x at
    width 256, 2 layers (GDN, attention), 4 x 512 tokens (1.26x at 4 layers
    and 4 x 1024); checked within [1, 1.5]."""
    over = ["model.hidden_size=256", "model.intermediate_size=512", "model.linear_num_key_heads=4",
            "model.linear_num_value_heads=8", "model.linear_key_head_dim=64", "model.linear_value_head_dim=64",
            "model.num_hidden_layers=2", "model.layer_types=null", "model.full_attention_interval=2",
            "model.num_attention_heads=4", "model.head_dim=64", "model.vocab_size=4096", "data.seq_len=512",
            "train.batch_size=4", "model.scan_layers=false"]
    p = plan(load_config("tiny", over), "v5e:2x2")
    assert 1.0 <= p.flops * p.chips / p.model_flops <= 1.5, p.flops * p.chips / p.model_flops


@pytest.mark.slow
def test_a_model_too_large_for_the_slice_is_refused_in_one_line():
    """Width 4096 at a 151,936-token vocabulary, parameters whole on each chip
    (data parallel only): float32 embeddings, their gradients and AdamW
    moments exceed a v5e chip's 16 GiB, which libtpu says as it compiles."""
    big = ["model.hidden_size=4096", "model.vocab_size=151936", "model.intermediate_size=128",
           "model.tie_word_embeddings=false", "data.seq_len=128", "train.batch_size=4"]
    with pytest.raises(ValueError, match=r"v5e:2x2: does NOT fit \(RESOURCE_EXHAUSTED.*parallel.fsdp"):
        plan(load_config("tiny", big), "v5e:2x2")


def test_cli_prints_the_plan(capsys):
    from gdnx.cli import main

    assert main(["plan", "tiny", "--topology", "v5e:2x2", "data.seq_len=128", "train.batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "v5e:2x2: 4 chips" in out and "fits" in out and "Pallas kernel calls" in out


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
def test_olmo_hybrid_7b_gdn_layer_compiles_with_the_slices_tiles(monkeypatch, topology):
    """OLMo-Hybrid-7B's GDN layer shape (30 key and value heads, K=96, V=192;
    a narrower model width, which the kernel does not see) under tensor=2:
    a shard holds 15 key heads. The step compiles with the slice's table
    entry (v5p's 16 value heads a grid step, v6e's 32; not this host's
    fallback of 8), whose head tile the kernel then fits to the 15 heads."""
    from gdnx.ops.delta_rule import dispatch, tiles

    chosen = []

    def spy(implementation, given, *, key_heads):
        out = choose(implementation, given, key_heads=key_heads)
        chosen.append((tiles.tiles_for(implementation), key_heads))
        return out

    choose = dispatch.choose_tiles
    monkeypatch.setattr(dispatch, "choose_tiles", spy)
    over = ["model.num_hidden_layers=1", "model.layer_types=null", "model.hidden_size=256", "model.vocab_size=512",
            "model.intermediate_size=256", "data.seq_len=256", "train.batch_size=2", "parallel.tensor=2",
            "parallel.data=-1", "parallel.fsdp=1"]
    p = plan(load_config("olmo-hybrid-7b", over), topology)
    assert p.kernel_calls > 0
    entry = tiles.TPU_TILES["TPU v5" if topology.startswith("v5p") else "TPU v6 lite"]
    assert set(chosen) == {(entry, 15)}  # (the slice's entry, key heads per shard)
    assert entry != tiles.TPU_FALLBACK


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["h100:4"])  # beside the TPU targets' process (make test)
def test_a_lora_step_over_a_quantized_base_is_planned_as_trained(topology):
    """train.lora: the plan compiles the adapters' step over the frozen base
    (here held in int8): the base is counted, and each chip holds far less
    than the full step's float32 parameters and AdamW moments."""
    import jax
    from flax import nnx

    from gdnx.models import CausalLM

    lora = ["model.quantize=int8", "train.lora.rank=4", "model.init_from=/checkpoint", "parallel.data=4"]
    model = nnx.eval_shape(lambda: CausalLM(load_config("tiny", SMALL).model))
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    qlora = plan(load_config("tiny", SMALL + lora), topology)
    assert qlora.fits and qlora.parameters > parameters  # the base, its factors and the adapters
    # data=4: a full step would hold every parameter and both moments on each chip, 12 bytes a parameter
    assert qlora.argument_bytes < 12 * parameters / 3


RL = ["data.source=rl", "data.path=prompts.jsonl", "train.rl.group_size=4", "train.batch_size=16", "data.seq_len=64",
      "train.rl.max_new_tokens=16"]


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["h100:1"])  # beside the TPU targets' process (make test)
def test_cli_plans_the_rl_update_and_its_rollout_engine(capsys, topology):
    """train.rl, bitwise: the update (the replay of the engine's prefill
    blocks and decode steps, the one-pass gradient; the kernels compiled)
    and the rollout engine's programs, and the run's peak of the two."""
    from gdnx.cli import main

    assert main(["plan", "tiny", "--topology", topology, *RL, "train.rl.bitwise=true"]) == 0
    out = capsys.readouterr().out
    assert f"{topology}: 1 chips" in out and "Pallas kernel calls" in out and "(0 Pallas" not in out
    assert "rollout engine (train.rl): 16 slots of 65 tokens" in out
    assert "RL run per chip: updating" in out and out.rstrip().endswith("fits")


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["h100:1"])
def test_the_default_rl_update_is_planned_on_the_rows(topology):
    """Default mode: the update reads rows of prompt + completion, placed
    as the trainer places them; it is not the cross-entropy step."""
    rl = plan(load_config("tiny", RL), topology)
    step = plan(load_config("tiny", ["data.seq_len=64", "train.batch_size=16"]), topology)
    assert rl.fits and rl.parameters == step.parameters and rl.kernel_calls > 0
    assert rl.argument_bytes > step.argument_bytes  # the rows' scores: five [16, 64] arrays beside the tokens


def test_a_plan_on_a_host_without_the_targets_hardware_starts_only_the_cpu(tmp_path):
    """`gdnx plan` with JAX_PLATFORMS unset, in an environment holding the
    CUDA plugin on a host with no GPU (this one): the plan prints, and no
    plugin's failed start-up traceback comes with it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # this test's process holds libtpu already (its lockfile)
    done = subprocess.run([sys.executable, "-m", "gdnx", "plan", "tiny", "--topology", "v5e:2x2"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "fits" in done.stdout, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Unable to initialize backend" not in done.stderr, done.stderr[-2000:]
