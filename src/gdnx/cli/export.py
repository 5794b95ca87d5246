"""`gdnx export`: a training run's newest intact checkpoint as a Hugging Face directory."""

from __future__ import annotations

import sys

from gdnx.config.reading import ConfigError


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="a training run's newest intact checkpoint as a Hugging Face directory",
                            description="Write the run's newest intact checkpoint as config.json and safetensors "
                                        "(sharded with an index above 4 GiB) in the family's Hugging Face layout, "
                                        "with the run's tokenizer files: what transformers loads.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a gdnx train.out_dir")
    export.add_argument("--out", required=True, help="the directory to write (new or empty)")
    form = export.add_mutually_exclusive_group()
    form.add_argument("--merge-lora", action="store_true",
                      help="a LoRA run (train.lora): its adapters merged into the base weights, as a whole model")
    form.add_argument("--adapter", action="store_true",
                      help="a LoRA run: its adapters as a PEFT adapter directory (adapter_config.json, "
                           "adapter_model.safetensors) for the base model (model.init_from)")
    export.add_argument("--fp8", action="store_true",
                        help="write the model (or with --merge-lora the merged one) as a block-scaled FP8 checkpoint: "
                             "float8_e4m3fn weights with a weight_scale_inv per block of model.quantize_block "
                             "(128 x 128), as Qwen and DeepSeek publish theirs")
    export.set_defaults(run=run)


def run(args) -> None:
    from pathlib import Path

    from gdnx.export import Form, export_run

    try:
        form: Form = "merge_lora" if args.merge_lora else "adapter" if args.adapter else "model"
        step, notes = export_run(Path(args.run_dir), Path(args.out), form, fp8=args.fp8)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for line in notes:
        print(f"gdnx export: {line}", file=sys.stderr)
    how = (f"peft: PeftModel.from_pretrained(base, {str(args.out)!r})" if args.adapter else
           f"transformers: AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    print(f"gdnx export: step {step} of {args.run_dir} written to {args.out} ({how})", file=sys.stderr)
