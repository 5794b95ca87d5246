"""`gdnx train`: train, or resume the run in train.out_dir from its latest intact checkpoint."""

from __future__ import annotations

from gdnx.cli.options import distributed_options
from gdnx.config.reading import DEFAULT_CONFIG, ConfigError, bundled_names


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a model (default: the tiny model on MQAR)",
                           description="Train, or resume the run in train.out_dir from its latest intact checkpoint.")
    train.add_argument("config", nargs="?", default=None,
                       help=f"a YAML file or a bundled config ({', '.join(bundled_names())}); "
                            f"default {DEFAULT_CONFIG}. A key=value here is taken as an override.")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.steps=100 parallel.tensor=4")
    distributed_options(train)
    train.set_defaults(run=run)


def run(args) -> None:
    from gdnx.checkpoints.orbax import quiet_refused_writes
    from gdnx.training import build_trainer
    from gdnx.training.init_from import load_train_config

    overrides = list(args.overrides)
    name = args.config
    if name is not None and "=" in name:
        name, overrides = None, [name] + overrides
    config = load_train_config(name, overrides)
    try:
        trainer = build_trainer(config)
    except (ValueError, OSError) as e:  # the library's refusal of a field, a file or a directory
        raise ConfigError(str(e)) from None
    quiet_refused_writes()
    trainer.run()
