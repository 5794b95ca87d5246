"""The public surface is typed: every public function and method of the
modules users import (and each layer's __init__ / __call__) annotates all of
its parameters and its return, so the type checker in `make test` (mypy on
src/) sees every call into gdnx."""

import importlib
import inspect
import pkgutil

import gdnx

# Modules whose public names are the user's API; the kernels' and the chunk
# algebra's internals are typed where they meet it (the op's signature).
SURFACE = ("gdnx.ops", "gdnx.layers", "gdnx.models", "gdnx.config", "gdnx.checkpoints", "gdnx.training",
           "gdnx.generate", "gdnx.parallel", "gdnx.data", "gdnx.aot", "gdnx.measure", "gdnx.train_plan", "gdnx.loss",
           "gdnx.serving")
INTERNAL = ("gdnx.ops.gated_delta_rule.math", "gdnx.ops.gated_delta_rule.pallas_gpu", "gdnx.ops.kda.math",
            "gdnx.ops.kda.pallas_gpu", "gdnx.ops.delta_rule.xla", "gdnx.ops.delta_rule.chunked",
            "gdnx.ops.delta_rule.layout", "gdnx.ops.delta_rule.reference", "gdnx.ops.delta_rule.pallas",
            "gdnx.ops.delta_rule.primitives", "gdnx.ops.delta_rule.triton")


def _modules():
    for info in pkgutil.walk_packages(gdnx.__path__, "gdnx."):
        if info.name.startswith(SURFACE) and not info.name.startswith(INTERNAL):
            yield importlib.import_module(info.name)


def _public_functions(module):
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) and not name.startswith("_"):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj) and not name.startswith("_"):
            for attr, fn in vars(obj).items():
                if getattr(fn, "__module__", None) != module.__name__:
                    continue  # put there by Python (a Protocol's __init__), not written in gdnx
                if inspect.isfunction(fn) and (not attr.startswith("_") or attr in ("__init__", "__call__")):
                    yield f"{module.__name__}.{name}.{attr}", fn


def _missing(fn) -> list[str]:
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        missing.append("return")
    return missing


def test_public_surface_is_annotated():
    untyped = {name: m for module in _modules() for name, fn in _public_functions(module) if (m := _missing(fn))}
    assert not untyped, "\n".join(f"{name}: {', '.join(m)}" for name, m in sorted(untyped.items()))
