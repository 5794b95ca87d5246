"""`gdnx train`'s loop: the Trainer (the compiled step and evaluation,
host-read batches), resume from the last intact checkpoint, then the step
and its hooks (gdnx.training.hooks: metrics to the trackers, evaluation,
checkpoints, the non-finite guard, preemption, early stop).

Batch s is a function of (seed, s) only, and a resumed run restores the
parameters and optimizer state of the last checkpoint, so stopping and
restarting continues the same run: no step lost or repeated. SIGTERM or
SIGINT stops the run after a step that every process agrees on, with a
checkpoint there (Preempted).

With several processes, each reads only its rows of a host-read batch,
every process writes its shards of a checkpoint, and process 0 alone
writes the rest (the lock, the log, the manifest, the plot, the bar).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from rich.console import Console

from gdnx.files import directory_lock, fingerprint
from gdnx.checkpoints.orbax import Checkpoints, check_base, check_compatible, has_checkpoints, record_base
from gdnx.distributed import StopSignals, agree
from gdnx.config.schema import Config
from gdnx.data import Batch, make_source
from gdnx.data.tokens import HostBatch, Prefetcher, host_batch
from gdnx.models import CausalLM
from gdnx.models.causal_lm import check_platform, parameter_count
from gdnx.parallel import make_mesh, shard, shardings, spec
from gdnx.progress import Reporter
from gdnx.models.adapters import adapter_spec
from gdnx.training.hooks import Hook, LoopState, Registered, Run, default_hooks
from gdnx.training.init_from import check_source, initial_params
from gdnx.training.step import (aux_loss_coef, batch_of, check_trainable, loss_and_metrics, make_optimizer,
                                make_step_fn)
from gdnx.training.trackers import METRICS_FILE, Tracker, check_trackers, dotted, make_trackers, rewrite_metrics

EVAL_BATCHES = 4


class Trainer:
    """Holds the compiled step functions; state is passed in and out. With a
    mesh, parameters and optimizer state are sharded per gdnx.parallel and
    every step runs under it."""

    def __init__(self, config: Config, *, mesh: jax.sharding.Mesh | None = None, platform: str | None = None):
        self.config, self.mesh = config, mesh
        check_platform(config.model, platform)
        self.frozen: Any = None  # the base weights under LoRA (self.params are then the adapters)
        spec = adapter_spec(config.train.lora)
        if config.model.init_from is None:
            self.graphdef, self.params = nnx.split(CausalLM(config.model, seed=config.train.seed), nnx.Param)
            if mesh is not None:
                self.params = shard(self.params, config.model, mesh)
        else:  # read straight into the mesh shardings
            check_source(config.model)
            abstract_model = nnx.eval_shape(lambda: CausalLM(config.model, adapters=spec))
            if spec is None:
                self.graphdef, abstract = nnx.split(abstract_model, nnx.Param)
            else:
                self.graphdef, adapters, abstract = nnx.split(  # type: ignore[misc]  # two filters, three parts
                    abstract_model, nnx.LoRAParam, nnx.Param)
            placement = None if mesh is None else shardings(abstract, config.model, mesh)
            self.params = initial_params(config.model, abstract, placement)
            if spec is not None:
                self.frozen = self.params
                self.params = jax.jit(
                    lambda: nnx.state(CausalLM(config.model, seed=config.train.seed, adapters=spec), nnx.LoRAParam),
                    out_shardings=None if mesh is None else shardings(adapters, config.model, mesh))()
        self.tx = make_optimizer(config.train)
        self._prefetch: Prefetcher | None = None
        self._compile()

    def _compile(self) -> None:
        """The data source and the compiled step and evaluation."""
        config = self.config
        out_dir = Path(config.train.out_dir)
        self.source = make_source(config.data, config.train.batch_size, config.model.vocab_size, out_dir=out_dir,
                                  evaluate=config.train.eval_every > 0, resuming=has_checkpoints(out_dir))
        self.tokenizer = self.source.tokenizer
        self.notes = self.source.notes  # what the run's log says of its data
        aux = aux_loss_coef(config)
        step_fn = make_step_fn(config, self.graphdef, self.tx, self.source.train)

        def eval_fn(params, index, batch, frozen):
            data = batch_of(self.source.evaluation, config.train.seed, index, batch)
            model = nnx.merge(self.graphdef, params) if frozen is None else nnx.merge(self.graphdef, params, frozen)
            return loss_and_metrics(model, data, aux)[1]

        self.step_fn = jax.jit(step_fn, donate_argnums=(0, 1))
        self.evaluate_one = jax.jit(eval_fn)

    def on_mesh(self) -> contextlib.AbstractContextManager:
        """The context the step functions trace and run in."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _batch_sharding(self) -> NamedSharding | None:
        if self.mesh is None:
            return None
        shape = (self.config.train.batch_size, self.config.data.seq_len)
        return NamedSharding(self.mesh, spec(("batch", "length"), shape, mesh=self.mesh))

    def _rows(self) -> range:
        """This process's rows of the global batch: those its devices hold."""
        sharding = self._batch_sharding()
        if sharding is None:
            return range(self.config.train.batch_size)
        return process_rows(sharding, (self.config.train.batch_size, self.config.data.seq_len))

    def device_batch(self, host: HostBatch) -> Batch:
        """A host batch as global arrays, each process giving its rows."""
        arrays = (host.inputs, host.targets, host.mask, host.mask, host.segments, host.target_bytes)
        shape = (self.config.train.batch_size, self.config.data.seq_len)
        sharding = self._batch_sharding()
        if sharding is None:
            return Batch(*(jnp.asarray(x) for x in arrays))
        return Batch(*(jax.make_array_from_process_local_data(sharding, x, shape) for x in arrays))

    def host_batch(self, which: str, step: int) -> HostBatch:
        make = self.source.train if which == "train" else self.source.evaluation
        assert make is not None  # evaluation exists when train.eval_every > 0
        rows, seed = make(self.config.train.seed)
        return host_batch(rows, seed, step, self._rows())

    def step(self, params: Any, opt_state: Any, step: jax.Array) -> tuple[Any, Any, dict[str, jax.Array]]:
        batch = None
        if not self.source.in_graph:
            if self._prefetch is None:
                self._prefetch = Prefetcher(lambda s: self.host_batch("train", s), int(step))
            batch = self.device_batch(self._prefetch.get(int(step)))
        with self.on_mesh():
            return self.step_fn(params, opt_state, step, batch, self.frozen)

    def close(self) -> None:
        """Stop the prefetch thread (host-read data); a later step starts another."""
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None

    def run(self, *, console: Console | None = None, hooks: Sequence[Hook | Registered] = ()) -> dict[str, float]:
        """Run (or resume) the run in the config's train.out_dir. Returns the
        last evaluation. The checkpoint manager, the metrics log, the progress
        display and the prefetch thread are closed on every exit: a finished
        run, a refusal, a failed save, a stop signal (Preempted), KeyboardInterrupt."""
        with contextlib.ExitStack() as resources:
            resources.callback(self.close)
            signals = resources.enter_context(StopSignals())
            return _loop(self, resources, signals, console, hooks)

    def init_opt_state(self, params: Any) -> Any:
        opt_state = self.tx.init(params)
        return opt_state if self.mesh is None else shard(opt_state, self.config.model, self.mesh)

    def evaluate(self, params: Any) -> dict[str, float]:
        """Metrics of EVAL_BATCHES held-out batches (MQAR: other seeds; text:
        the validation split), averaged; text adds perplexity."""
        runs = []
        for i in range(EVAL_BATCHES):
            batch = None if self.source.in_graph else self.device_batch(self.host_batch("eval", i))
            with self.on_mesh():
                runs.append(self.evaluate_one(params, jnp.asarray(i, jnp.int32), batch, self.frozen))
        out = {k: float(sum(r[k] for r in runs) / EVAL_BATCHES) for k in runs[0]}
        if "bits_per_byte" in out:
            out["perplexity"] = math.exp(min(out["loss"], 700.0))
        return out


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> range:
    """The rows (first axis) of a global array of `shape` that this
    process's devices hold; contiguous, as every gdnx mesh orders them."""
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        spans.add((rows.start or 0, shape[0] if rows.stop is None else rows.stop))
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    if sum(b - a for a, b in spans) != stop - start and len(spans) > 1:
        raise ValueError(f"parallel: this process's devices hold rows {sorted(spans)} of the batch, not one run of "
                         "rows; order the mesh so that each process's devices are neighbours")
    return range(start, stop)


def _check_out_dir(out: Path) -> None:
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if out.exists() and not out.is_dir():
        raise ValueError(f"train.out_dir {out}: exists and is not a directory")
    for name in ("checkpoints", "checksums"):  # where the run writes its checkpoints
        if (out / name).exists() and not (out / name).is_dir():
            raise ValueError(f"train.out_dir {out}: {name} there is a file, where the run keeps its checkpoints; "
                             "move it away or use another train.out_dir")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"train.out_dir {out}: {existing} is not writable")


def memory_capacity(devices: list[jax.Device]) -> int:
    """Bytes the devices hold (host memory on CPU). Another process's
    devices are taken to hold what this process's devices of their kind do."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    if local and all(limits):
        return int(sum(limits) * len(devices) / len(local))  # type: ignore[arg-type]
    hosts = len({d.process_index for d in devices})
    return hosts * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # host memory (CPU)


def _check_fits(config: Config, devices: list[jax.Device]) -> None:
    """Refuse, before building anything, a model whose training state
    (parameters, gradients, two AdamW moments) cannot fit the devices."""
    count = parameter_count(config.model)
    # under LoRA the base has no gradients or moments (its adapters' are small)
    copies, what = (1, "the frozen base") if config.train.lora else (4, "parameters, gradients and AdamW moments")
    need = copies * count * jnp.dtype(config.model.param_dtype).itemsize
    have = memory_capacity(devices)
    if need > have:
        raise ValueError(f"model: {count / 1e9:.1f}B parameters need about {need / 2 ** 30:,.0f} GiB for {what}, "
                         f"and these {len(devices)} device(s) hold "
                         f"{have / 2 ** 30:,.0f} GiB; a full-size bundled config is a base for a run on a slice "
                         "that holds it (docs/sharding.md), or for a smaller model of its family")
    tokens = config.train.batch_size * config.data.seq_len
    # at the least, one micro-batch's input and output of every layer, and the batch's six int32 arrays
    micro = tokens // config.train.grad_accum_steps
    batch = micro * config.model.hidden_size * jnp.dtype(config.model.dtype).itemsize * \
        (config.model.num_hidden_layers + 1) + 6 * 4 * tokens
    if tokens >= 2 ** 31 or need + batch > have:
        raise ValueError(f"train.batch_size: {config.train.batch_size} rows of {config.data.seq_len} tokens need at "
                         f"least {batch / 2 ** 30:,.1f} GiB for the batch and its activations beside "
                         f"{need / 2 ** 30:,.1f} GiB for the model, and these {len(devices)} device(s) hold "
                         f"{have / 2 ** 30:,.1f} GiB; lower train.batch_size or raise train.grad_accum_steps")


def _run_record(config: Config) -> dict[str, Any]:
    """The config's fields (dotted) and the data files' fingerprint: what
    the processes of one run must agree on."""
    record = dotted(config)
    # prepared token shards are read by every process from data.path (text and SFT corpora are prepared once,
    # by process 0, into the out_dir, with a fingerprint of their own)
    if config.data.source == "tokens" and config.data.path is not None and Path(config.data.path).exists():
        record["data.path (its files)"] = fingerprint([Path(config.data.path)])
    return record


def check_run(config: Config) -> jax.sharding.Mesh:
    """Everything that can refuse a run before its trainer is built and
    anything is written: the out_dir, the mesh, the out_dir's earlier
    config, whether the model fits. Returns the mesh. Raises ValueError (or
    OSError for a file) naming the field or path."""
    check_trainable(config)
    out = Path(config.train.out_dir)
    _check_out_dir(out)
    check_trackers(config)
    agree("config", _run_record(config))  # every process of the run, the same config and data
    mesh = make_mesh(config.parallel)
    check_compatible(out, config)
    check_base(out, config)
    _check_fits(config, list(mesh.devices.flat))
    return mesh


def _loop(trainer: Trainer, resources: contextlib.ExitStack, signals: StopSignals, console: Console | None,
          extra: Sequence[Hook | Registered]) -> dict[str, float]:
    """Open the run, resume it, then step and call the hooks until the last
    step or a hook ends the run."""
    report, ckpt, start = _open(trainer, resources, console)
    params, opt_state = _resume(trainer, ckpt, start, report)
    trackers = _trackers(trainer.config, resources, start, report)
    bar = resources.enter_context(report.progress(start, trainer.config.train.steps))
    run = Run(trainer.config, Path(trainer.config.train.out_dir), trainer, ckpt, signals, report, bar, trackers,
              start)
    return _step(trainer, LoopState(run, start, params, opt_state), default_hooks(trainer.config, extra))


def _open(trainer: Trainer, resources: contextlib.ExitStack, console: Console | None,
          ) -> tuple[Reporter, Checkpoints, int]:
    """The run's directory (locked by process 0), its reporter and
    checkpoints, and the step it resumes from (0: a new run)."""
    config = trainer.config
    out = Path(config.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    primary = jax.process_index() == 0  # on several hosts, one logs, plots and shows the bar
    report = Reporter(console=console, quiet=not primary)
    if primary:  # one run at a time in a directory: the first process of a run holds it
        stale = resources.enter_context(directory_lock(out, "train.out_dir"))
        if stale is not None:
            report.note(f"train.out_dir {out}: its lock was left by a run that ended without releasing it "
                        f"(pid {stale}); taken over")
    ckpt = Checkpoints(out, config)
    resources.callback(ckpt.close)
    intact, damaged = ckpt.latest_intact_step()
    for line in damaged:
        report.note(line)
    start = intact or 0
    if primary and not start:
        record_base(out, config)  # what a LoRA run's adapters are trained on
    for line in trainer.notes:
        report.note(line)
    if trainer.mesh is not None:
        axes = " x ".join(f"{n}={s}" for n, s in trainer.mesh.shape.items())
        report.note(f"mesh {axes} ({config.parallel.shard_mode})")
    if config.train.target_accuracy is not None and not config.train.eval_every:
        report.note(f"train.target_accuracy {config.train.target_accuracy} is not checked: train.eval_every=0 runs "
                    "no evaluation, so the run takes all its train.steps")
    return report, ckpt, start


def _resume(trainer: Trainer, ckpt: Checkpoints, start: int, report: Reporter) -> tuple[Any, Any]:
    """The parameters and optimizer state to start from: the checkpoint at
    `start`, or the trainer's initial ones."""
    params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
    if not start:
        return params, opt_state
    params, opt_state = ckpt.restore(start, params, opt_state)
    report.note(f"resumed from the checkpoint at step {start} in {ckpt.dir}")
    if "train.steps" in ckpt.changes:
        before, now = ckpt.changes["train.steps"]
        report.note(f"train.steps: {before} there, {now} here: the learning rate's cosine decay now ends at "
                    f"step {now}, so the steps after {start} differ from those of the {before}-step run")
    return params, opt_state


def _trackers(config: Config, resources: contextlib.ExitStack, start: int, report: Reporter) -> list[Tracker]:
    """Process 0's trackers, the metrics log cut back to `start`."""
    if jax.process_index() != 0:
        return []
    out = Path(config.train.out_dir)
    metrics_file = out / METRICS_FILE
    if dropped := rewrite_metrics(metrics_file, start):
        report.note(f"{metrics_file}: dropped {dropped} damaged line(s) (a write cut short)")
    trackers = make_trackers(config, out, start)
    for tracker in trackers:
        resources.callback(tracker.close)
    return trackers


def _step(trainer: Trainer, loop: LoopState, hooks: list[Registered]) -> dict[str, float]:
    """Step, and call the hooks due after each step, until the last step or
    a hook ends the run. Returns the step reached and the last evaluation."""
    for registered in hooks:
        registered.hook.start(loop)
    while loop.stop is None and not loop.done:
        loop.params, loop.opt_state, metrics = trainer.step(loop.params, loop.opt_state,
                                                            jnp.asarray(loop.step, jnp.int32))
        loop.step += 1
        for registered in hooks:
            if registered.due(loop):
                registered.hook.after_step(loop, metrics)
    if isinstance(loop.stop, BaseException):
        raise loop.stop
    if loop.stop is not None:
        loop.run.report.note(loop.stop)
        if loop.step == loop.run.start:  # nothing run
            return {"step": loop.step, **loop.last_eval}
    loop.run.report.finish(loop.run.out, loop.step)
    return {"step": loop.step, **loop.last_eval}
