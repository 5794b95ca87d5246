"""`gdnx export`: a training run's newest intact checkpoint as a Hugging
Face directory (config.json, safetensors, sharded with an index above 4
GiB, and the run's tokenizer files) that transformers loads."""

from __future__ import annotations

import shutil
from pathlib import Path

from gdnx.config.schema import Config

# beside a tokenizer.json, the files transformers' tokenizer also reads
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def run_tokenizer(config: Config) -> Path | None:
    """The tokenizer.json a run's text was tokenized with (None: raw bytes
    or MQAR, which have none)."""
    from gdnx.data.prepare import prepared_tokenizer

    if config.data.source in ("text", "sft"):
        return None if config.data.tokenizer is None else Path(config.data.tokenizer)
    if config.data.source == "tokens":
        found = prepared_tokenizer(Path(config.data.path or ""))
        return None if found is None else Path(found)
    return None


def export_run(run_dir: Path, out: Path) -> tuple[int, list[str]]:
    """Write run_dir's newest intact checkpoint to `out` (new or empty) as a
    Hugging Face directory. Returns its step and one note per thing worth
    saying (a damaged newer checkpoint skipped, no tokenizer to copy)."""
    from gdnx.runs import is_run, load_run

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    if not is_run(run_dir):
        raise ValueError(f"RUN_DIR {run_dir}: not a gdnx training run (checkpoints/ and config.json)")
    model, config, step, notes = load_run(run_dir)
    model.save_pretrained(out)
    tokenizer = run_tokenizer(config)
    if tokenizer is None:
        notes.append(f"the run ({config.data.source}{' as raw bytes' if config.data.source != 'mqar' else ''}) "
                     "has no tokenizer.json: none copied")
    else:
        for name in _TOKENIZER_FILES:
            if (tokenizer.parent / name).is_file() and (name != "tokenizer.json" or tokenizer.name == name):
                shutil.copyfile(tokenizer.parent / name, out / name)
        if tokenizer.name != "tokenizer.json":
            shutil.copyfile(tokenizer, out / "tokenizer.json")
    return step, notes
