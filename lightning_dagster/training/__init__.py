"""Training from recorded spans: transitions (spans -> rows), rollout-level advantages, the policy loss, the
torch trainer, the warm start of the first parent, and the one RL loop (`loop.train_rl`) through the real
runner and gateway; `configs` turns the user's settings into these modules' configs."""
