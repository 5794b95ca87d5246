"""Training checkpoints with orbax: parameters and optimizer state by step,
written atomically (orbax finalises a step directory only when complete),
plus the run's config so a resume can refuse another config's checkpoints.

Each checkpoint also gets a manifest of SHA-256 checksums of its files
(checksums/<step>.json, written after the checkpoint is complete). A
checkpoint whose files do not match, or that has no manifest, is damaged:
resuming reports it, moves it aside (damaged/<step>) and takes the newest
intact one. Checkpoints beyond train.keep_checkpoints are deleted only after
the new one's manifest is written, so a kill at any moment leaves an intact
checkpoint behind.

With several processes, each writes its shards (orbax's multi-process
save); process 0 writes the manifest, the config and moves damaged
checkpoints aside, and tells the others which step to resume from. The
run directory must be one filesystem that every process sees.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from gdnx.files import atomic_write_text, fingerprint, read_json_object
from gdnx.config.schema import Config

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Fields whose change alters what a resumed run computes; the others (steps,
# cadences, logging, the mesh, memory and kernel knobs) may change on resume.
# train.steps moves the end of the learning-rate decay: the loop says so.
_FREE_MODEL_FIELDS = ("gdn_implementation", "moe_implementation", "moe_split", "gdn_interpret", "gdn_residuals",
                      "attention_implementation", "attention_interpret",
                      "remat_policy")
_FIXED_TRAIN_FIELDS = ("batch_size", "learning_rate", "warmup_steps", "min_lr_ratio", "weight_decay", "adam_b1",
                       "adam_b2", "grad_clip", "seed", "lora")


class CheckpointDamaged(ValueError):
    """No intact checkpoint is left to resume from."""


def _fixed(config: dict) -> dict[str, Any]:
    out = {f"model.{k}": v for k, v in config.get("model", {}).items() if k not in _FREE_MODEL_FIELDS}
    out.update({f"data.{k}": v for k, v in config.get("data", {}).items()})
    out.update({f"train.{k}": config.get("train", {}).get(k) for k in _FIXED_TRAIN_FIELDS})
    return out


def _read_config(out_dir: Path) -> dict | None:
    saved_file = out_dir / CONFIG_FILE
    if not saved_file.is_file():
        return None
    return read_json_object(saved_file, "restore it, or use another train.out_dir")


def is_run(path: Path) -> bool:
    """Whether `path` is a gdnx training run's directory (checkpoints/ and config.json)."""
    return (path / "checkpoints").is_dir() and (path / CONFIG_FILE).is_file()


def check_compatible(out_dir: Path, config: Config) -> None:
    """Refuse to resume the run in out_dir with a change that alters its
    results, naming each changed field with its old and new value. A
    directory without a checkpoint (a first run that failed before its
    first save) holds nothing to resume: any config may start there."""
    if not has_checkpoints(out_dir):
        return
    saved = _read_config(out_dir)
    if saved is None:  # the checkpoints' shapes alone cannot say which fields they were trained with
        raise ValueError(f"train.out_dir {out_dir} holds checkpoints but no {CONFIG_FILE} to say which config made "
                         f"them; restore {CONFIG_FILE}, or move checkpoints/ away to start over")
    before, now = _fixed(saved), _fixed(json.loads(config.model_dump_json()))
    diffs = [f"{k}: {before.get(k)!r} there, {v!r} here" for k, v in now.items() if before.get(k) != v]
    if diffs:
        raise ValueError(f"train.out_dir {out_dir} holds checkpoints of another config ({'; '.join(diffs[:4])}); "
                         "use another train.out_dir or the same values")


BASE_FILE = "base.json"


def base_fingerprint(base: Path) -> str:
    """What a LoRA run's base (model.init_from) holds, as a fingerprint: a
    Hugging Face directory's config.json and weight files, or a gdnx run's
    config and checkpoint checksums (a newer checkpoint there is another
    base)."""
    if is_run(base):
        return fingerprint([base / CONFIG_FILE, base / "checksums"])
    return fingerprint([base / "config.json", *sorted(base.glob("*.safetensors")),
                        *sorted(base.glob("*.safetensors.index.json"))])


def record_base(out_dir: Path, config: Config) -> None:
    """A LoRA run's base, recorded at its start (base.json in out_dir)."""
    if config.train.lora is None or config.model.init_from is None:
        return
    base = Path(config.model.init_from)
    atomic_write_text(out_dir / BASE_FILE, json.dumps({"init_from": str(base),
                                                       "fingerprint": base_fingerprint(base)}) + "\n")


def check_base(out_dir: Path, config: Config) -> None:
    """Refuse a LoRA run (to resume, export or load) whose base changed
    since the run started: its adapters were trained on other weights."""
    record = out_dir / BASE_FILE
    if config.train.lora is None or config.model.init_from is None or not record.is_file():
        return
    saved = read_json_object(record, "restore it, or delete it to accept the base as it is now")
    now = base_fingerprint(Path(config.model.init_from))
    if saved.get("fingerprint") != now:
        raise ValueError(f"model.init_from: {config.model.init_from} changed since the LoRA run in {out_dir} started "
                         f"(fingerprint {saved.get('fingerprint')} then, {now} now); its adapters were trained on the "
                         "old weights: restore that base, or train new adapters in another train.out_dir")


def has_checkpoints(out_dir: Path) -> bool:
    """Whether a train.out_dir holds a checkpoint (intact or not)."""
    steps = out_dir / "checkpoints"
    return steps.is_dir() and any(p.name.isdigit() for p in steps.iterdir())


def config_changes(out_dir: Path, config: Config) -> dict[str, list]:
    """The fields that differ from the run's saved config: {field: [old, new]}."""
    saved = _read_config(out_dir)
    if saved is None:
        return {}
    now = json.loads(config.model_dump_json())
    return {f"{section}.{k}": [saved.get(section, {}).get(k), v] for section, fields in now.items()
            for k, v in fields.items() if saved.get(section, {}).get(k) != v}


def _os_error(e: BaseException) -> OSError | None:
    """The OSError inside an orbax / tensorstore write error, if it is one."""
    if isinstance(e, OSError):
        return e
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code is None:
        return None
    path = re.search(r'Failed writing: "([^"]+)"', str(e))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1))), path.group(1) if path else None)


def quiet_refused_writes() -> None:
    """Keep orbax's worker threads and asyncio from printing tracebacks of a
    write the machine refused: Checkpoints.save reports it as one OSError."""
    default_hook = threading.excepthook

    def hook(args):
        if args.exc_value is None or _os_error(args.exc_value) is None:
            default_hook(args)
    threading.excepthook = hook

    class _Refused(logging.Filter):
        def filter(self, record):
            exc = record.exc_info[1] if record.exc_info else None
            return not (exc is not None and _os_error(exc) is not None) and "os_error_code" not in record.getMessage()
    logging.getLogger("asyncio").addFilter(_Refused())


def _digest(directory: Path) -> dict[str, str]:
    out = {}
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            h = hashlib.sha256()
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            out[str(f.relative_to(directory))] = h.hexdigest()
    return out


UNFINISHED = "it has no checksum manifest (the run stopped before writing it)"


def damage(step_dir: Path, manifest: Path) -> str | None:
    """What is wrong with a checkpoint, or None when every file matches its checksum."""
    if not manifest.is_file():
        return UNFINISHED
    try:
        want = json.loads(manifest.read_text())
    except ValueError:
        return f"its checksum manifest {manifest} is not valid JSON"
    have = _digest(step_dir)
    for name, digest in want.items():
        if name not in have:
            return f"{name} is missing"
        if have[name] != digest:
            return f"{name} does not match its checksum"
    return None


class Checkpoints:
    def __init__(self, out_dir: Path, config: Config):
        self.out_dir = out_dir
        self.dir = out_dir / "checkpoints"
        self.sums = out_dir / "checksums"
        self.keep = config.train.keep_checkpoints
        self.primary = jax.process_index() == 0
        self.manager = self._manager()
        changes = self.changes = config_changes(out_dir, config)
        if not self.primary:
            return
        if changes:  # allowed changes on resume are recorded
            record = json.dumps({"step": self.manager.latest_step(), "changed": changes})
            history = out_dir / CHANGES_FILE
            atomic_write_text(history, (history.read_text() if history.is_file() else "") + record + "\n")
        atomic_write_text(out_dir / CONFIG_FILE, config.model_dump_json(indent=2))

    def _manager(self) -> ocp.CheckpointManager:
        # max_to_keep stays None: orbax would delete the oldest inside save(),
        # before the new checkpoint's manifest exists (see save)
        return ocp.CheckpointManager(self.dir.resolve(), options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True))

    def latest_intact_step(self) -> tuple[int | None, list[str]]:
        """The newest checkpoint whose files match their checksums, and one
        line per damaged newer one (moved aside to damaged/). Raises
        CheckpointDamaged when there are checkpoints and none is intact, unless
        the only one is the first checkpoint left unfinished by a kill: the
        run then starts over, as if killed before it."""
        step, damaged = newest_intact(self.out_dir, self.manager.all_steps()) if self.primary else (None, [])
        first_unfinished = step is None and len(damaged) == 1 and damaged[0][1] == UNFINISHED
        refused = bool(damaged) and step is None and not first_unfinished
        if damaged and not refused:
            self.manager.close()
            for s, _ in damaged:
                target = self.out_dir / "damaged" / str(s)
                target.parent.mkdir(exist_ok=True)
                shutil.rmtree(target, ignore_errors=True)
                (self.dir / str(s)).rename(target)
                (self.sums / f"{s}.json").unlink(missing_ok=True)
        if jax.process_count() > 1:  # process 0 judged; every process takes its word
            from jax.experimental import multihost_utils

            word = multihost_utils.broadcast_one_to_all(np.asarray([-1 if step is None else step, len(damaged),
                                                                    refused], np.int64))
            step, moved, refused = (None if word[0] < 0 else int(word[0])), int(word[1]), bool(word[2])
        else:
            moved = len(damaged)
        if refused:
            raise CheckpointDamaged(f"train.out_dir {self.out_dir}: no intact checkpoint ("
                                    + "; ".join(f"step {s}: {what}" for s, what in damaged)
                                    + "); move checkpoints/ and checksums/ away to start over")
        if moved:
            if not self.primary:
                self.manager.close()
            self.manager = self._manager()
        lines = [f"the checkpoint at step {s} is damaged: {what}; moved to {self.out_dir / 'damaged' / str(s)}"
                 for s, what in damaged]
        if first_unfinished:
            lines.append("no earlier checkpoint: training starts from step 0")
        return step, lines

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any) -> None:
        """Write the checkpoint of `step`; a write the machine refuses (a full
        disk, a file size limit, no permission) raises OSError."""
        self._check_room(sum(x.nbytes for x in jax.tree.leaves((params, opt_state))))
        try:
            self.manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                            opt_state=ocp.args.StandardSave(opt_state)))
            self.manager.wait_until_finished()
        except Exception as e:
            refused = _os_error(e)
            if refused is None:
                raise
            raise refused from None
        if self.primary:
            self.sums.mkdir(exist_ok=True)
            atomic_write_text(self.sums / f"{step}.json", json.dumps(_digest(self.dir / str(step)), indent=1))
        # only now, with the new checkpoint verifiable, may the oldest go
        # (a collective: process 0 deletes, the others wait for it)
        for old in sorted(self.manager.all_steps())[:-self.keep] if self.keep else []:
            self.manager.delete(old)
        if self.primary:
            kept = {f"{s}.json" for s in self.manager.all_steps()}
            for stale in self.sums.glob("*.json"):
                if stale.name not in kept:
                    stale.unlink()

    def _check_room(self, nbytes: int) -> None:
        """Refuse a checkpoint the disk or the file size limit cannot take
        before orbax starts writing (its failed writes are noisy)."""
        need = nbytes + 2 ** 20
        free = shutil.disk_usage(self.dir).free
        if need > free:
            raise OSError(errno.ENOSPC, f"No space left on device ({need / 2 ** 20:,.1f} MiB needed, "
                          f"{free / 2 ** 20:,.1f} MiB free)", str(self.dir))
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and need > limit:
            raise OSError(errno.EFBIG, f"File too large (a checkpoint of {need / 2 ** 20:,.1f} MiB; the file size "
                          f"limit, ulimit -f, is {limit / 2 ** 20:,.1f} MiB)", str(self.dir))

    def restore(self, step: int, abstract_params: Any, abstract_opt_state: Any) -> tuple[Any, Any]:
        tree = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params), opt_state=ocp.args.StandardRestore(abstract_opt_state)))
        return tree["params"], tree["opt_state"]

    def close(self) -> None:
        self.manager.close()


def newest_intact(run_dir: Path, steps: Any) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest of `steps` whose checkpoint under run_dir is intact (None
    if none is), and (step, what is wrong) for each newer one."""
    damaged: list[tuple[int, str]] = []
    for step in sorted(steps, reverse=True):
        what = damage(run_dir / "checkpoints" / str(step), run_dir / "checksums" / f"{step}.json")
        if what is None:
            return step, damaged
        damaged.append((step, what))
    return None, damaged


def load_params(run_dir: Path, abstract_params: Any) -> tuple[Any, int, list[str]]:
    """Parameters of the newest intact checkpoint under a train.out_dir (for
    generate), its step, and one line per damaged newer checkpoint. Leaves
    of `abstract_params` without a sharding are placed on this process's
    first device, whatever mesh wrote the checkpoint."""
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract_params = jax.tree.map(
        lambda x: x if getattr(x, "sharding", None) is not None else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                                           sharding=here),
        abstract_params)
    manager = ocp.CheckpointManager((run_dir / "checkpoints").resolve())
    try:
        step, damaged = newest_intact(run_dir, manager.all_steps())
        notes = [f"the checkpoint at step {s} is damaged: {what}; skipped" for s, what in damaged]
        if step is None:
            raise FileNotFoundError(f"{run_dir}: no intact checkpoint under checkpoints/" + (
                " (" + "; ".join(f"step {s}: {what}" for s, what in damaged) + ")" if damaged else ""))
        try:
            tree = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
        except (ValueError, KeyError) as e:
            raise ValueError(f"{run_dir}: the checkpoint at step {step} does not fit this model "
                             f"({str(e).splitlines()[0][:200]})") from None
    finally:
        manager.close()
    return tree["params"], step, notes
