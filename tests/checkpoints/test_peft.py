"""PEFT adapters (gdnx.checkpoints.peft): what a run's adapters cannot be
written as. tests/training/test_lora.py loads the adapters it writes in PEFT
against transformers, per family."""

import pytest

from gdnx.checkpoints.peft import save_adapter
from gdnx.config.schema import LoraConfig, ModelConfig


def test_a_qwen3_next_adapter_of_the_shared_expert_is_refused_before_anything_is_written(tmp_path):
    """PEFT puts a qwen3_next adapter's MLP targets on the routed experts,
    not the shared expert the run adapted: refused, naming them (the
    default targets include them), and nothing written."""
    with pytest.raises(ValueError, match="--adapter: PEFT loads a qwen3_next adapter's down_proj, gate_proj, "
                                         "up_proj onto the routed experts"):
        save_adapter(ModelConfig(family="qwen3_next"), LoraConfig(), {}, tmp_path / "adapter", "base")
    assert not (tmp_path / "adapter").exists()
