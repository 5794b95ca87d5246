"""A reward for `gdnx train` (train.rl.reward=rewards:close, with
examples/rl on PYTHONPATH): how close a completion's last number comes to
the answer, 1 - |number - answer| / |answer| (at least 0; 1 exactly when
it is the answer; 0 without a number). A model that adds no sum exactly yet
still earns more for answers nearer the sum: a signal from the first
steps, where the exact answer alone (train.rl.reward=numeric) scores 0
nearly always."""

from gdnx.rl.rewards import last_number


def close(completion: str, example: dict) -> float:
    answer = float(example["answer"])
    got = last_number(completion)
    return 0.0 if got is None else max(0.0, 1.0 - abs(got - answer) / max(abs(answer), 1.0))
