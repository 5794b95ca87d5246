"""Reinforcement learning from verifiable rewards: prompts, rewards, the
policy-gradient objectives and the replay of the engine's computation
that `gdnx train` (data.source=rl, gdnx.training.rl) runs."""
