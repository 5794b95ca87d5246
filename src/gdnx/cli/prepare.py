"""`gdnx prepare`: tokenize text into memory-mapped shards for data.source=tokens."""

from __future__ import annotations

from gdnx.config.reading import ConfigError


def add_parser(sub) -> None:
    prep = sub.add_parser("prepare", help="tokenize text into memory-mapped shards for data.source=tokens",
                          description="Tokenize .txt / .jsonl files (or directories of them) into token shards "
                                      "with a document index and a validation split; a rerun on the same inputs "
                                      "does nothing.")
    prep.add_argument("inputs", nargs="+", help=".txt files (one document each), .jsonl files ({\"text\": ...} "
                                                "per line) or directories of them")
    prep.add_argument("--out", required=True, help="the directory to write (then: data.source=tokens data.path=OUT)")
    prep.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: raw bytes)")
    prep.add_argument("--val-fraction", type=float, default=0.05,
                      help="documents held out for evaluation (default 0.05)")
    prep.add_argument("--eos-token", default=None,
                      help="the tokenizer's end-of-document token (default: the first of <|endoftext|>, </s>, "
                           "<eos>, <|end_of_text|>, [SEP] it has)")
    prep.set_defaults(run=run)


def run(args) -> None:
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from gdnx.data.prepare import prepare_corpus

    console = Console(stderr=True)
    with Progress("prepare", BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("prepare", total=None)
        try:
            meta = prepare_corpus([Path(p) for p in args.inputs], Path(args.out), tokenizer=args.tokenizer,
                                  eos_token=args.eos_token, val_fraction=args.val_fraction,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
    splits = meta["splits"]
    state = "up to date" if meta.get("up_to_date") else "written"
    console.print(f"{args.out}: {state}; train {splits['train']['tokens']:,} tokens in "
                  f"{splits['train']['documents']:,} documents, validation {splits['val']['tokens']:,} tokens in "
                  f"{splits['val']['documents']:,}; train with data.source=tokens data.path={args.out}",
                  highlight=False, soft_wrap=True)
