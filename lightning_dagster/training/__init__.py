"""Training from recorded spans: merged transitions, rollout-level advantages, the policy loss, the torch
trainer, the supervised warm start of the first parent, and the RL loop through the real runner and gateway.

Modules: `transitions` (spans -> rows), `advantages` (rewards -> one value per rollout), `loss` (PPO clip,
truncated IS, KL, normalizations), `trainer` (one optimizer step), `warmstart` (the first parent), `step`
(one RL step and the held-out evaluation; rollouts run by `runner.service.RolloutService`), `loop` (the one
RL loop, `train_rl`, with checkpoint selection and the other ranks of a process group), `configs` (the user's
settings -> these modules' configs), `cli` (`lightning-dagster train`).
"""
