"""`gdnx plan`: a train step (with train.rl the RL update and its rollout engine), or with --serve
the serving engine's programs, compiled for a TPU slice or GPUs from this host: bytes per device,
whether they fit, compile time, FLOPs."""

from __future__ import annotations

import os

from gdnx.cli.options import overrides, quantize_option
from gdnx.config.reading import ConfigError, bundled_names
from gdnx.serving.config import EngineConfig


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="compile one train step for a TPU slice or a GPU host from this host: "
                                       "bytes per chip, FLOPs, compile time",
                          description="Build the model abstractly, compile its sharded train step (the Pallas "
                                      "kernels, compiled) for a TPU topology with libtpu or for the GPUs of one host "
                                      "with the CUDA plugin, and print the bytes each chip holds, whether that fits "
                                      "its memory, the compile time and the FLOPs per step (with train.rl: the RL "
                                      "update, then the rollout engine's programs and the run's peak). Needs "
                                      "jax[tpu] (libtpu) "
                                      "or jax[cuda12-local] (ptxas); no accelerator.")
    plan.add_argument("config", help=f"a YAML file or a bundled config ({', '.join(bundled_names())})")
    plan.add_argument("--topology", required=True,
                      help="a TPU slice: v4, v5e, v5p or v6e with its shape, e.g. v5p:4x4x4, v5e:4x4, one chip v5e:1x1; or N GPUs of "
                           "one host: h100:8, h200:8, a100:8")
    quantize_option(plan)
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="config overrides, e.g. parallel.fsdp=-1 parallel.data=1 train.batch_size=64")
    serving = plan.add_argument_group("--serve: the serving engine's programs instead (docs/serving.md)")
    serving.add_argument("--serve", action="store_true",
                         help="compile the engine's prefill, decode and verify programs (gdnx serve's) instead of a "
                              "train step: bytes per chip for the weights, the slots and the temporaries, the most "
                              "slots that fit, FLOPs per decode step")
    default = EngineConfig()
    serving.add_argument("--max-slots", type=int, default=default.max_slots,
                         help=f"requests decoded together (default {default.max_slots})")
    serving.add_argument("--max-length", type=int, default=default.max_length,
                         help=f"prompt + generated tokens per request (default {default.max_length})")
    serving.add_argument("--speculative", default=str(default.draft_tokens), metavar="K|mtp[:K]",
                         help="draft tokens per verify pass, as gdnx serve's (mtp: the multi-token prediction "
                              "module's state and drafting counted too; default 0: no verify program)")
    serving.add_argument("--draft-rows", type=int, default=default.draft_rows, metavar="N",
                         help="as gdnx serve's: the verify pass compiled at the most decode rows that draft "
                              "(default: every slot on the target)")
    serving.add_argument("--decode-steps", type=int, default=default.decode_steps,
                         help=f"tokens per slot per decode call (default {default.decode_steps})")
    serving.add_argument("--max-prefill-batch", type=int, default=None, metavar="N",
                         help="prompts prefilled together, at most (default: --max-slots, at most 8)")
    serving.add_argument("--prefix-cache-mb", type=int, default=1024,
                         help="as gdnx serve's (default 1024; 0: off): with a prefix cache the prefill also returns "
                              "the states at block ends")
    plan.set_defaults(run=run)


def local_backend() -> None:
    """JAX's local backend as a plan needs it: the host's CPU (the target's
    compiler is loaded by its topology, not as a device). Unless the user
    chose JAX_PLATFORMS, no other local backend is started: an installed
    plugin without its hardware (the CUDA plugin on a host with no GPU)
    otherwise logs a traceback as it fails to start, successful plans too."""
    import jax

    if os.environ.get("JAX_PLATFORMS") is None:
        jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu's topology needs no TPU VM


def run(args) -> None:
    from gdnx.config import load_config
    from gdnx.inference import engine_config, speculation
    from gdnx.train_plan import describe, plan

    config = load_config(args.config, overrides(args))
    local_backend()
    try:
        if args.serve:
            if args.prefix_cache_mb < 0:
                raise ValueError("--prefix-cache-mb: expected a non-negative integer")
            from gdnx.serving.plan import describe as describe_serving
            from gdnx.serving.plan import serve_plan

            engine = engine_config(max_slots=args.max_slots, max_length=args.max_length,
                                   **speculation(args.speculative, config.model), decode_steps=args.decode_steps,
                                   draft_rows=args.draft_rows,
                                   max_prefill_batch=args.max_prefill_batch)
            print(describe_serving(serve_plan(config, args.topology, engine, prefix_cache=args.prefix_cache_mb > 0)))
            return
        result = plan(config, args.topology)
        print(describe(result))
        if config.train.rl is not None:  # the rollout engine beside the update
            from gdnx.serving.plan import serve_plan
            from gdnx.train_plan import describe_rl
            from gdnx.training.rl import rl_engine

            rollout = serve_plan(config, args.topology, rl_engine(config),
                                 prefix_cache=config.train.rl.prefix_cache_mb > 0)
            print(describe_rl(result, rollout))
    except ValueError as e:  # the topology, the mesh, a model field or an engine setting
        raise ConfigError(str(e)) from None
