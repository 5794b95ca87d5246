"""YAML config files, `base:` inheritance and key=value overrides.

    load_config("tiny", ["train.steps=100", "model.gdn_implementation=xla"])

A config names its parent with `base: <file or bundled name>`; mappings merge
key by key, the child winning. Overrides are dotted keys with YAML values
("true", "1e-3", "[0, 2]"), type-checked by the schema like the file itself;
a value holding `#` is taken as written (YAML would cut it at a comment:
`train.out_dir=runs/exp #2` is the directory "runs/exp #2").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pydantic
import yaml

from gdnx.config.schema import Config
from gdnx.errors import FieldError

BUNDLED = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "tiny"


class ConfigError(ValueError):
    """A config file, field or override the user has to fix; the message
    names it."""


class ConfigFieldError(ConfigError, FieldError):
    """A config field the schema refuses; `.field` is its dotted name
    (e.g. train.batch_size)."""


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.yml"))


def _resolve(name: str, relative_to: Path | None = None) -> Path:
    path = Path(name)
    candidates = [path] if path.is_absolute() else [(relative_to or Path.cwd()) / path]
    if path.suffix not in (".yml", ".yaml"):
        candidates.append(BUNDLED / f"{name}.yml")
    for c in candidates:
        if c.is_file():
            return c.resolve()  # one spelling per file: a `base` chain through `..` or a link is seen to loop
    raise ConfigError(f"config {name!r}: no such file, and not a bundled config ({', '.join(bundled_names())})")


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path in seen:
        raise ConfigError(f"config {path}: `base` chain loops back to itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read(_resolve(base, path.parent), seen + (path,)), data)


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _merge({}, data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
        value: object
        if "#" in raw and not raw.lstrip().startswith(("'", '"', "[", "{")):
            value = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw else None
            except yaml.YAMLError:
                value = raw
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[leaf] = value
    return data


def format_validation_error(err: pydantic.ValidationError, prefix: str = "") -> str:
    """One line per problem: `section.field: what is wrong`."""
    return "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in validation_problems(err, prefix))


def validation_problems(err: pydantic.ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted field, what is wrong) per problem ("" where no field is named)."""
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "literal_error":
            msg = msg.replace("Input should be", "expected")
        if e["type"] not in ("extra_forbidden",) and "input" in e and e["type"] != "value_error":
            msg += f" (got {e['input']!r})"
        if e["type"] == "value_error" and ": " in msg and " " not in msg.split(": ", 1)[0]:
            # a model-level check names the field itself
            field, msg = msg.split(": ", 1)
            loc = f"{loc}.{field}" if loc else field
        out.append((loc, msg))
    return out


def build_config(data: dict) -> Config:
    try:
        return Config.model_validate(data)
    except pydantic.ValidationError as e:
        problems = validation_problems(e)
        field, first = problems[0]
        rest = "".join(f"; {loc}: {msg}" if loc else f"; {msg}" for loc, msg in problems[1:])
        if field:
            raise ConfigFieldError(field, first + rest) from None
        raise ConfigError(format_validation_error(e)) from None


def read_config_data(name: str | None = None, overrides: Sequence[str] = ()) -> dict:
    """The config file (path or bundled name; the tiny model when None) with
    its bases merged and overrides applied, not yet validated: the keys it
    sets, as written."""
    return apply_overrides(_read(_resolve(name or DEFAULT_CONFIG)), list(overrides))


def load_config(name: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """The config file (path or bundled name; the tiny model when None) with
    overrides applied, validated."""
    return resolve_paths(build_config(read_config_data(name, overrides)))


def resolve_paths(config: Config) -> Config:
    """The config with its file paths absolute (from the working directory), so
    a run's saved config works from anywhere."""
    absolute = lambda p: None if p is None else str(Path(p).expanduser().resolve())  # noqa: E731
    return config.model_copy(update={
        "model": config.model.model_copy(update={"init_from": absolute(config.model.init_from)}),
        "train": config.train.model_copy(update={"out_dir": absolute(config.train.out_dir)}),
        "data": config.data.model_copy(update={"path": absolute(config.data.path),
                                               "tokenizer": absolute(config.data.tokenizer)})})
