"""`gdnx eval`: lm-evaluation-harness tasks on a gdnx run or a Hugging
Face directory, in process, with lm-eval's flag meanings and output files
(the results JSON, per-task sample JSONL, the table)."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

from gdnx.config.reading import ConfigError
from gdnx.signals import handled
from gdnx.cli.options import distributed_options, overrides, quantize_option



def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate with lm-evaluation-harness (its tasks, flags and output files)",
                        description="Run lm-evaluation-harness tasks in process on a gdnx run or a Hugging Face "
                                    "directory: scoring through the model on its mesh, generation through the "
                                    "batched engine (docs/evaluation.md). Needs lm-eval (pip install lm-eval).")
    ev.add_argument("--checkpoint", required=True,
                    help="a gdnx train.out_dir (its latest checkpoint) or a Hugging Face directory")
    ev.add_argument("--tasks", required=True, help="comma-separated task (or group) names, as lm-eval's --tasks")
    ev.add_argument("--include-path", default=None, help="a directory of task YAMLs (and their data) to add")
    ev.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    ev.add_argument("--limit", type=float, default=None,
                    help="at most N examples per task (a fraction below 1: that share); for checks")
    ev.add_argument("--batch-size", type=int, default=8, help="rows per scoring call, requests generated together "
                                                              "(default 8)")
    ev.add_argument("--output-path", default=None, help="a directory for the results JSON (and the samples)")
    ev.add_argument("--log-samples", action="store_true", help="also write each sample's requests and responses "
                                                               "(JSONL per task; needs --output-path)")
    ev.add_argument("--apply-chat-template", action="store_true", help="render prompts with the checkpoint's "
                                                                       "chat template")
    ev.add_argument("--seed", type=int, default=0, help="the few-shot sampler's and generation's seed (default 0)")
    quantize_option(ev)
    ev.add_argument("overrides", nargs="*", metavar="key=value",
                    help="model.gdn_* and model.dtype overrides; parallel.* places the model on a mesh of this "
                         "host's devices (of every process's, with --distributed), e.g. parallel.tensor=4")
    distributed_options(ev)
    ev.set_defaults(run=run_eval)


def run_eval(args) -> None:
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("gdnx eval needs lm-evaluation-harness: pip install lm-eval") from None

    if args.batch_size < 1:
        raise ConfigError("--batch-size: expected a positive integer")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError("--num-fewshot: expected a non-negative integer")
    if args.limit is not None and not (math.isfinite(args.limit) and args.limit > 0):
        raise ConfigError(f"--limit: expected a positive number (N examples, or a share below 1), got {args.limit}")
    if args.log_samples and args.output_path is None:
        raise ConfigError("--log-samples: writes the samples under --output-path; give one")
    if args.output_path is not None:
        check_output_path(Path(args.output_path))
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include-path: no such directory {args.include_path}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks: expected one or more task names")
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        unread = _unreadable_yaml(Path(args.include_path)) if args.include_path is not None else None
        raise ConfigError(f"--tasks: unknown task {unknown[0]!r} (`lm-eval ls tasks` lists them; "
                          "--include-path adds a directory of task YAMLs)"
                          + (f"; {unread[0]} did not parse: {unread[1]}" if unread else ""))
    for name in tasks:
        _check_local_data(manager, name)
        _check_task(manager, name)
    interrupt = _Interrupt()
    with handled(interrupt.handle, (signal.SIGINT,)):
        _evaluate(args, tasks, manager, interrupt)


class _Interrupt:
    """Ctrl-C ends `gdnx eval` at once, status 130, past the interpreter's
    teardown: raised as KeyboardInterrupt it was swallowed where it landed
    in a garbage-collector callback (the evaluation ran on to its end, status
    0) or crashed the teardown of lm-eval's, torch's and JAX's threads
    (a segmentation fault). Results are written at the end; a Ctrl-C while
    they are written waits for them, so no file is left part written."""

    def __init__(self) -> None:
        self.writing, self.pending = False, False

    def handle(self, signum: int, frame: object) -> None:
        if self.writing:
            self.pending = True
            return
        self.stop("nothing written")

    def stop(self, what: str) -> None:
        print(f"gdnx eval: interrupted; {what}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


def _evaluate(args, tasks: list[str], manager, interrupt: _Interrupt) -> None:
    import jax
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import make_table

    from gdnx.evaluation import GdnxLM
    from gdnx.inference import chat_template, load

    loaded = load(Path(args.checkpoint), overrides(args), "eval")
    chat = chat_template(loaded, "eval") if args.apply_chat_template else None
    if args.apply_chat_template and chat is None:
        raise ConfigError("--apply-chat-template: this checkpoint has no chat template")
    try:
        lm = GdnxLM(loaded, batch_size=args.batch_size, chat=chat)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    writes = jax.process_index() == 0
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path and writes else None
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, log_samples=args.log_samples,
        evaluation_tracker=tracker, apply_chat_template=args.apply_chat_template, task_manager=manager,
        random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed)
    if results is None or not writes:
        return
    samples = results.pop("samples", None)
    written = []
    interrupt.writing = True
    if tracker is not None:
        # lm-eval logs a warning and goes on when it cannot write: each file is looked for afterwards
        tracker.save_results_aggregated(results=results, samples=samples if args.log_samples else None)
        written.append(_results_file(tracker))
        if args.log_samples and samples is not None:
            for task_name in results["configs"]:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
                written.append(_results_file(tracker, task_name))
    interrupt.writing = False
    if interrupt.pending:
        interrupt.stop(f"the results were written first ({', '.join(map(str, written)) or 'none'})")
    print(f"gdnx eval: {loaded.description}, limit: {args.limit}, num_fewshot: {args.num_fewshot}, "
          f"batch_size: {args.batch_size}", file=sys.stderr)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    missing = [f for f in written if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more files" if len(missing) > 1 else ""
        raise ConfigError(f"--output-path: could not write {missing[0]}{more} (lm-eval's warning above says why); "
                          "the table above is all that is left of the results")


# datasets' builders of local files: without data_files they read every file of the working directory
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")


def _check_local_data(manager, name: str) -> None:
    """A task whose data is local files (dataset_path json, csv, ...) names
    them: without dataset_kwargs.data_files, datasets would read the
    working directory's files as its data."""
    entry = getattr(manager, "task_index", {}).get(name)
    cfg = getattr(entry, "cfg", None)
    if not isinstance(cfg, dict) or cfg.get("dataset_path") not in _LOCAL_BUILDERS:
        return
    kwargs = cfg.get("dataset_kwargs") or {}
    if not (kwargs.get("data_files") or kwargs.get("data_dir")):
        path = getattr(entry, "yaml_path", None)
        where = f" ({path})" if path else ""
        raise ConfigError(f"--tasks: task {name!r}{where} reads local {cfg['dataset_path']} files but names none: "
                          "give dataset_kwargs.data_files (e.g. test: path/to/data.jsonl)")


def _unreadable_yaml(directory: Path) -> tuple[Path, str] | None:
    """The first task YAML under `directory` that does not parse, and why
    (lm-eval skips such a file with a warning, and its task is then unknown)."""
    import yaml

    class Lenient(yaml.SafeLoader):
        """lm-eval's tags (!function) read as plain values: only the syntax is checked."""

    Lenient.add_multi_constructor("", lambda loader, suffix, node: None)
    for path in sorted(directory.rglob("*.yaml")):
        try:
            yaml.load(path.read_text(errors="replace"), Lenient)  # noqa: S506  # a SafeLoader subclass
        except yaml.YAMLError as e:
            return path, " ".join(str(e).split())[:200]
    return None


def _check_task(manager, name: str) -> None:
    """Build the task and render its first document's prompt, target and
    choices, before the model loads: a task file's mistake (an unknown
    output_type, a template naming a missing field) is one line naming the
    task and its file, not lm-eval's traceback after the model has loaded."""
    entry = getattr(manager, "task_index", {}).get(name)
    path = getattr(entry, "yaml_path", None) or (name if Path(name).is_file() else None)
    where = f"task {name!r}" + (f" ({path})" if path else "")
    try:
        built = manager.load([name])
        for task in built["tasks"].values():
            docs = task.eval_docs
            doc = next(iter(docs), None) if docs is not None else None
            if doc is None:
                continue
            task.doc_to_text(doc)
            task.doc_to_target(doc)
            if task.OUTPUT_TYPE == "multiple_choice":
                task.doc_to_choice(doc)
    except Exception as e:  # noqa: BLE001  # lm-eval's and jinja's errors for a task file are many kinds
        raise ConfigError(f"--tasks: {where}: {type(e).__name__}: {' '.join(str(e).split())[:240]}") from None


def check_output_path(path: Path) -> None:
    """lm-eval writes under --output-path as a directory (or beside it, for a
    path ending in .json): refuse one it could not write, before the model loads."""
    directory = path.parent if path.suffix == ".json" else path
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--output-path: {directory} is a file; give a directory (or a path ending in .json)")
    parent = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        raise ConfigError(f"--output-path: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-path: {parent} is not writable")


def _results_file(tracker, task: str | None = None) -> Path:
    """Where lm-eval's tracker wrote the aggregated results (task None) or a task's samples."""
    path, date = Path(tracker.output_path), getattr(tracker, "date_id", "DATE")  # set as it writes
    directory = path.parent if path.suffix == ".json" else path / tracker.general_config_tracker.model_name_sanitized
    if task is not None:
        return directory / f"samples_{task}_{date}.jsonl"
    if path.suffix == ".json":
        return path.with_name(f"{path.stem}_{date}.json")
    return directory / f"results_{date}.json"
