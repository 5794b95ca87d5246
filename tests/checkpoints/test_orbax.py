"""Training checkpoints: checksums written with each one, a damaged latest
checkpoint (flipped bytes, a truncated file, no manifest) reported and
moved aside, the newest intact one resumed; none intact is one line, except
a first checkpoint a kill left unfinished: the run starts over."""

import json

import jax
import numpy as np
import pytest

from gdnx.checkpoints.orbax import CheckpointDamaged, Checkpoints, damage
from gdnx.cli import main
from gdnx.config import load_config
from gdnx.training import train
from tests.helpers.configs import SMALL_RUN
from tests.helpers.checkpoints import saved_params


def _config(out, steps, **kw):
    return load_config("tiny", SMALL_RUN + [f"train.steps={steps}", "train.checkpoint_every=3",
                                        "train.keep_checkpoints=3", f"train.out_dir={out}"])


def _biggest_file(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip(path, count=64):
    data = bytearray(path.read_bytes())
    for i in np.random.default_rng(0).choice(len(data), count, replace=False):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _no_manifest(out):
    (out / "checksums" / "6.json").unlink()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(_config(out, 9))
    return saved_params(out)


@pytest.mark.slow
@pytest.mark.parametrize("harm", ["flip", "truncate", "no_manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact(tmp_path, capsys, straight, harm):
    train(_config(tmp_path, 6))
    manifest = json.loads((tmp_path / "checksums" / "6.json").read_text())
    assert manifest and all(len(h) == 64 for h in manifest.values())
    if harm == "flip":
        _flip(_biggest_file(tmp_path / "checkpoints" / "6"))
    elif harm == "truncate":
        _truncate(_biggest_file(tmp_path / "checkpoints" / "6"))
    else:
        _no_manifest(tmp_path)
    assert damage(tmp_path / "checkpoints" / "6", tmp_path / "checksums" / "6.json") is not None
    assert damage(tmp_path / "checkpoints" / "3", tmp_path / "checksums" / "3.json") is None
    capsys.readouterr()
    train(_config(tmp_path, 9))
    err = capsys.readouterr().err
    assert "the checkpoint at step 6 is damaged" in err and "resumed from the checkpoint at step 3" in err
    assert (tmp_path / "damaged" / "6").is_dir()
    step, params = saved_params(tmp_path)
    assert step == straight[0] == 9
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(straight[1]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_line(tmp_path, capsys):
    train(_config(tmp_path, 3))
    _flip(_biggest_file(tmp_path / "checkpoints" / "3"))
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint \(step 3: .* does not match its checksum\)"):
        Checkpoints(tmp_path, _config(tmp_path, 6)).latest_intact_step()
    capsys.readouterr()
    argv = ["train", "tiny", *SMALL_RUN, "train.steps=6", "train.checkpoint_every=3", "train.keep_checkpoints=3",
            f"train.out_dir={tmp_path}"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdnx")]
    assert len(err) == 1 and "no intact checkpoint" in err[0]
    # generate says the same, in one line
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "1 2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdnx")]
    assert len(err) == 1 and "no intact checkpoint under checkpoints/ (step 3: " in err[0], err


@pytest.mark.slow
def test_an_unfinished_first_checkpoint_starts_over(tmp_path, capsys, straight):
    """A kill between orbax finishing the first checkpoint and its checksum
    manifest: the run starts from step 0 (as if killed before it) and ends
    where an uninterrupted run does; the unfinished checkpoint is kept aside."""
    train(_config(tmp_path, 3))
    (tmp_path / "checksums" / "3.json").unlink()
    capsys.readouterr()
    train(_config(tmp_path, 9))
    err = capsys.readouterr().err
    assert "step 3 is damaged: it has no checksum manifest" in err and "starts from step 0" in err
    assert "resumed from" not in err and (tmp_path / "damaged" / "3").is_dir()
    step, params = saved_params(tmp_path)
    assert step == straight[0] == 9
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(straight[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == sorted(set(steps))


@pytest.mark.slow
def test_keeping_one_checkpoint_never_leaves_none_intact(tmp_path, capsys, straight, monkeypatch):
    """train.keep_checkpoints=1: the previous checkpoint is deleted only
    after the new one's manifest is written. A kill just before that
    manifest (simulated: its write fails) leaves the previous checkpoint
    intact, and the next run resumes from it and ends where an uninterrupted
    run does."""
    import gdnx.checkpoints.orbax as module

    one = lambda steps: load_config("tiny", SMALL_RUN + [f"train.steps={steps}", "train.checkpoint_every=3",  # noqa: E731
                                                     "train.keep_checkpoints=1", f"train.out_dir={tmp_path}"])
    train(one(3))
    real = module.atomic_write_text

    def killed_at_step_6(path, text):
        if path.name == "6.json":
            raise KeyboardInterrupt  # the process dies here
        real(path, text)
    monkeypatch.setattr(module, "atomic_write_text", killed_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(one(9))
    monkeypatch.setattr(module, "atomic_write_text", real)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    capsys.readouterr()
    train(one(9))
    err = capsys.readouterr().err
    assert "step 6 is damaged: it has no checksum manifest" in err and "resumed from the checkpoint at step 3" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["9"]
    assert sorted(p.name for p in (tmp_path / "checksums").iterdir()) == ["9.json"]
    step, params = saved_params(tmp_path)
    assert step == straight[0] == 9
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(straight[1]), strict=True):
        np.testing.assert_array_equal(a, b)
