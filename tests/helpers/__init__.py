"""What many tests share, so that no test module imports another's:
tiny model configs (configs), Hugging Face checkpoints and tokenizers
(hf_models), subprocess runs (processes), the `gdnx` command in-process
(cli), `gdnx serve` in a subprocess (serving), small datasets (data), saved
runs (checkpoints), model views (models), evaluation fixtures (evaluation).
Directory-level helpers sit beside their tests (tests/parallel/helpers.py,
tests/ops/delta_rule/)."""
