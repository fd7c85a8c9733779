"""Training from recorded spans: merged transitions, rollout-level advantages, the policy loss, the torch
trainer, the supervised warm start of the first parent, and the RL loop through the real runner and gateway.

Modules: `transitions` (spans -> rows), `advantages` (rewards -> one value per rollout), `loss` (PPO clip,
truncated IS, KL, normalizations), `trainer` (one optimizer step), `warmstart` (the first parent), `loop`
(one RL step, `train_rl`, held-out evaluation; rollouts run by `runner.service.RolloutService`),
`cli` (`lightning-dagster train`).
"""
