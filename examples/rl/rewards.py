"""A reward for `gdnx train` (train.rl.reward=rewards:digits, with
examples/rl on PYTHONPATH): the share of a completion's characters that
are digits, plus 1 when its last number is the answer. The first part
gives a model that has never seen the task a signal from its first
steps; the second is the verifiable answer."""

from gdnx.rl.rewards import last_number


def digits(completion: str, example: dict) -> float:
    share = sum(c.isdigit() for c in completion) / max(len(completion), 1)
    got = last_number(completion)
    return share + float(got is not None and got == float(example["answer"]))
