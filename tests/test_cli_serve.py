"""`gdnx serve`'s refusals before it serves: one line, status 2 (the
server itself: tests/serving/test_server.py)."""

import socket

import pytest

from gdnx.cli import main
from tests.hf_models import random_hf_model, write_chat_tokenizer
from tests.test_cli import _error


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    random_hf_model("qwen3_5").save_pretrained(path)
    write_chat_tokenizer(path)
    return path


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        err = _error(capsys, ["serve", "--checkpoint", str(tmp_path / "none"), "--port", str(port)])
    assert f"--port: cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.parametrize("flags,match", [
    (["--max-slots", "0"], "--max-slots: expected a positive integer"),
    (["--max-queue", "-1"], "--max-queue: expected a non-negative integer"),
    (["--grace", "-5"], "--grace: expected a non-negative integer"),
    (["--port", "70000"], "--port: expected 0 (any free port) to 65535"),
    (["--max-length", "100000"], "--max-length: 100000 exceeds the model's"),
    (["--speculative", "-1"], "--speculative: expected a non-negative integer"),
    (["model.hidden_size=8"], "model.hidden_size: serve takes overrides of the model.gdn_* fields"),
])
def test_each_bad_flag_is_one_line(checkpoint, capsys, flags, match):
    err = _error(capsys, ["serve", "--checkpoint", str(checkpoint), "--port", "0", *flags])
    assert match in err, err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    err = _error(capsys, ["serve", "--checkpoint", str(tmp_path / "none"), "--port", "0"])
    assert "--checkpoint: no such directory" in err
