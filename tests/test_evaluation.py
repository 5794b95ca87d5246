"""`gdnx eval`: lm-evaluation-harness tasks in process. On local task YAMLs
(multiple choice, perplexity, generation; no network) the per-sample
log-likelihoods equal lm-eval's own `hf` backend's on the same checkpoint
within 1e-4 relative (float32, two implementations of one model), with the
same greedy flags, accuracies and generated texts; lm-eval's output files
are written; bad input is one line."""

import json

import numpy as np
import pytest

from gdnx.cli import main
from tests.helpers.cli import refused
from tests.helpers.evaluation import first_logprob, read_samples, write_model_and_tasks

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.xdist_group("evaluation")  # one worker builds the checkpoint and the reference
TASKS = "tiny_mc,tiny_ppl,tiny_gen"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
        yield write_model_and_tasks(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="module")
def reference(setup):
    """lm-eval's own hf backend on the checkpoint (transformers, float32)."""
    from lm_eval.tasks import TaskManager

    path, tasks = setup
    return lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(path), "dtype": "float32",
                                                           "device": "cpu"},
                                   tasks=TASKS.split(","), batch_size=1, log_samples=True,  # see the chat check
                                   task_manager=TaskManager(include_path=str(tasks)))


def _same_numbers(results: dict, samples: dict, ref: dict, tasks: list[str]) -> None:
    """Per sample: log-likelihoods within 1e-4 relative, the same greedy
    flags and generated texts; per task: the same metrics."""
    for task in tasks:
        got, want = (sorted(x[task], key=lambda s: s["doc_id"]) for x in (samples, ref["samples"]))
        assert [s["doc_id"] for s in got] == [s["doc_id"] for s in want]
        for g, w in zip(got, want):
            if task == "tiny_gen":
                assert g["resps"] == w["resps"]
                continue
            # resps: per request [[logprob, greedy]] (multiple choice) or [logprob] (rolling); a samples
            # file holds them as lm-eval writes them (strings)
            lg, lw = (np.asarray([first_logprob(r) for r in x["resps"]], np.float64) for x in (g, w))
            np.testing.assert_allclose(lg, lw, rtol=1e-4)
            if task == "tiny_mc":
                assert [str(r[0][1]) for r in g["resps"]] == [str(bool(r[0][1])) for r in w["resps"]]
        for metric, value in ref["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                assert results[task][metric] == pytest.approx(value, rel=1e-4), (task, metric)


def test_gdnx_eval_gives_lm_evals_hf_numbers(setup, reference, tmp_path, capsys):
    path, tasks = setup
    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(path), "--tasks", TASKS, "--include-path", str(tasks),
                 "--batch-size", "4", "--output-path", str(out), "--log-samples"]) == 0
    table = capsys.readouterr().out
    assert "tiny_mc" in table and "acc" in table and "word_perplexity" in table
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {task: read_samples(out, task) for task in TASKS.split(",")}
    _same_numbers(results, samples, reference, TASKS.split(","))


@pytest.mark.multiprocess
def test_gdnx_eval_on_two_processes_gives_the_same_numbers(setup, reference, tmp_path, processes):
    """2 processes x 4 CPU devices, one mesh (data 2 x tensor 4): every
    process runs the same requests (SPMD), process 0 writes the files and
    the table, which hold lm-eval's hf numbers; process 1 writes nothing."""
    import subprocess

    from tests.helpers.processes import LIMIT_S, cpu_env, free_port, gdnx

    path, tasks = setup
    out = tmp_path / "out"
    port = free_port()
    procs = [processes.start(gdnx("eval", "--checkpoint", str(path), "--tasks", TASKS, "--include-path", str(tasks),
                                  "--batch-size", "4", "--output-path", str(out), "--log-samples",
                                  "parallel.data=2", "parallel.tensor=4", "--coordinator", f"127.0.0.1:{port}",
                                  "--num-processes", "2", "--process-id", str(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=cpu_env(devices=4, HF_DATASETS_OFFLINE="1"))
             for i in range(2)]
    done = [p.communicate(timeout=LIMIT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], done
    assert "tiny_mc" in done[0][0] and done[1][0] == ""
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {task: read_samples(out, task) for task in TASKS.split(",")}
    _same_numbers(results, samples, reference, TASKS.split(","))


@pytest.mark.slow
def test_lm_evals_api_backends_against_gdnx_serve(setup, reference):
    """lm-eval's local-completions backend (token-id prompts, echo with
    logprobs) against `gdnx serve`: the hf backend's numbers; its
    local-chat-completions backend (generation, the checkpoint's chat
    template): the hf backend's texts with the chat template applied."""
    from lm_eval.tasks import TaskManager
    from tests.helpers.serving import Server

    path, tasks = setup
    manager = TaskManager(include_path=str(tasks))
    server = Server(path, "--warm-up", "decode", "--max-length", "256", env={"GDNX_API_KEY": ""})
    try:
        scored = ["tiny_mc", "tiny_ppl"]
        got = lm_eval.simple_evaluate(
            model="local-completions", tasks=scored, log_samples=True, task_manager=manager,
            model_args={"base_url": f"{server.url}/v1/completions", "model": "tiny", "tokenizer": str(path),
                        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                        "max_retries": 1, "max_length": 256})
        chat = lm_eval.simple_evaluate(
            model="local-chat-completions", tasks=["tiny_gen"], log_samples=True, task_manager=manager,
            apply_chat_template=True, model_args={"base_url": f"{server.url}/v1/chat/completions", "model": "tiny",
                                                  "num_concurrent": 1, "max_retries": 1})
    finally:
        server.stop()
    _same_numbers(got["results"], got["samples"], reference, scored)
    # one prompt per batch: so the hf backend stops at the end-of-turn token (<|im_end|>, the
    # tokenizer's eos) as the server does; in a batch of several, lm-eval 0.4.13's hf backend generated past it
    want = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(path), "dtype": "float32",
                                                           "device": "cpu"},
                                   tasks=["tiny_gen"], batch_size=1, log_samples=True, apply_chat_template=True,
                                   task_manager=manager)
    _same_numbers(chat["results"], chat["samples"], want, ["tiny_gen"])


@pytest.mark.parametrize("flags,match", [
    (["--tasks", "no_such_task"], "--tasks: unknown task 'no_such_task'"),
    (["--tasks", "tiny_mc", "--include-path", "/no/such/dir"], "--include-path: no such directory"),
    (["--tasks", "tiny_mc", "--log-samples"], "--log-samples: writes the samples under --output-path"),
    (["--tasks", "tiny_mc", "--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["--tasks", "tiny_mc", "--limit", "nan"], "--limit: expected a positive number"),
    (["--tasks", "tiny_mc", "--output-path", "{dir}/model.safetensors"], "model.safetensors is a file; give a"),
    (["--tasks", "tiny_mc", "--output-path", "{dir}/config.json/r.json"], "config.json is a file; give a directory"),
    (["--tasks", "tiny_mc", "--output-path", "{dir}/config.json/sub/r"], "config.json is not a directory"),
])
def test_each_eval_mistake_is_one_line(setup, capsys, flags, match):
    path, tasks = setup
    flags = [x.format(dir=path) for x in flags]
    if "--include-path" not in flags:
        flags = [*flags, "--include-path", str(tasks)]
    assert match in refused(capsys, ["eval", "--checkpoint", str(path), *flags])


def test_a_task_of_local_files_that_names_none_is_one_line(setup, tmp_path, capsys):
    """dataset_path json without data_files: datasets would read the working
    directory's files as the task's data; refused before anything loads."""
    (tmp_path / "nofiles.yaml").write_text("task: nofiles\ndataset_path: json\ntest_split: test\n"
                                          "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                                          "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    err = refused(capsys, ["eval", "--checkpoint", str(setup[0]), "--tasks", "nofiles", "--include-path",
                          str(tmp_path)])
    assert "--tasks: task 'nofiles'" in err and "give dataset_kwargs.data_files" in err, err


@pytest.mark.parametrize("edit,match", [
    ({"output_type": "nonsense"}, "ValueError: Got invalid output_type 'nonsense'"),
    ({"doc_to_text": "'{{nothere}}'"}, "UndefinedError: 'nothere' is undefined"),
    ({"doc_to_choice": "'{{nothere}}'", "output_type": "multiple_choice"}, "'nothere' is undefined"),
    ({"task": "broken\n  x: ["}, "--tasks: unknown task 'broken'"),
])
def test_a_task_file_mistake_is_one_line_naming_the_task_and_file(setup, tmp_path, capsys, edit, match):
    """Each task is built and its first document's prompt, target and
    choices rendered before the model loads: lm-eval's exceptions for a
    task file are one line naming the task and its file; a file that does
    not parse (lm-eval skips it with a warning) is named with the reason."""
    (tmp_path / "data.jsonl").write_text('{"question": "a b", "answer": "c", "choices": ["c", "d"]}\n')
    fields = {"task": "bad", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
              "doc_to_text": "'{{question}}'", "doc_to_target": "'{{answer}}'", **edit}
    text = "".join(f"{k}: {v}\n" for k, v in fields.items())
    text += f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\nmetric_list:\n  - metric: exact_match\n"
    (tmp_path / "bad.yaml").write_text(text)
    name = "broken" if "broken" in fields["task"] else "bad"
    err = refused(capsys, ["eval", "--checkpoint", str(setup[0]), "--tasks", name, "--include-path", str(tmp_path)])
    assert match in err, err
    assert f"{tmp_path / 'bad.yaml'}" in err, err


def test_short_requests_share_rows():
    """First fit, longest first; each call's rows take its longest
    request's bucket: every request once, no row past its length, at most
    `batch` rows a call."""
    from gdnx.evaluation import _pack

    lengths = [10, 50, 20, 30, 64, 5, 100, 3, 7, 40]
    calls = _pack(lengths, batch=2, limit=128)
    assert sorted(i for _, rows in calls for row in rows for i in row) == list(range(len(lengths)))
    for length, rows in calls:
        assert len(rows) <= 2 and all(sum(lengths[i] for i in row) <= length for row in rows)
    # 100, then 64 + 50 fill a call of 128; 40 and 30 open one of 64; the rest fill the first gaps
    assert calls == [(128, [[6, 2, 8], [4, 1, 0, 7]]), (64, [[9, 5], [3]])]


@pytest.mark.slow
def test_ctrl_c_while_evaluating_ends_at_once_with_130_and_writes_nothing(setup, tmp_path, processes):
    """Ctrl-C once the scoring has begun: one line, status 130, no results
    file (a KeyboardInterrupt landing in a garbage-collector callback was
    swallowed and the run went on; at exit the teardown crashed)."""
    import signal
    import subprocess

    from tests.helpers.processes import gdnx

    path, tasks = setup
    out = tmp_path / "out"
    proc = processes.start(gdnx("eval", "--checkpoint", str(path), "--tasks", TASKS, "--include-path", str(tasks),
                                "--output-path", str(out)), stderr=subprocess.PIPE, text=True, errors="replace")
    seen = []
    for line in proc.stderr:  # scoring has begun: the progress bar's first line
        seen.append(line)
        if "loglikelihood" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert processes.wait(proc, 120) == 130, "".join(seen) + rest
    lines = [x for x in ("".join(seen) + rest).replace("\r", "\n").splitlines() if "gdnx eval:" in x]
    assert len(lines) == 1 and lines[0].endswith("gdnx eval: interrupted; nothing written"), lines
    assert "Traceback" not in rest and "Segmentation" not in rest
    assert not out.exists() or not list(out.rglob("*.json*"))
