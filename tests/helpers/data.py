"""Small datasets the fine-tuning tests train on."""


def copy_examples(n, rng):
    """Completions that copy the prompt: something a few steps can learn."""
    out = []
    for i in range(n):
        words = " ".join(f"w{int(x)}" for x in rng.integers(6, 97, int(rng.integers(2, 7))))
        out.append({"messages": [{"role": "user", "content": words}, {"role": "assistant", "content": words}]}
                   if i % 2 else {"prompt": words, "completion": " " + words})
    return out
