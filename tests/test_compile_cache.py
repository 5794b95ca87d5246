"""gdnx serve's XLA flags: chosen only where XLA_FLAGS does not choose them, the
optimisation level only where no GPU backend could read it."""

import importlib.util

from gdnx import compile_cache


def test_cpu_flags_fill_in_what_xla_flags_leaves_open(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    compile_cache.cpu_flags()
    assert compile_cache.os.environ["XLA_FLAGS"].split() == [
        "--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    compile_cache.cpu_flags()
    assert compile_cache.os.environ["XLA_FLAGS"].split() == [
        "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]


def test_the_optimisation_level_is_left_alone_where_a_gpu_plugin_is_installed(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "jax_cuda12_plugin" else real(name, *a))
    compile_cache.cpu_flags()
    assert compile_cache.os.environ["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=false"
