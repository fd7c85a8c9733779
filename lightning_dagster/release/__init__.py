"""Release authorization: who may move `approved-default` and the continual-learning loop (`roles`,
`approvals`, `pauses`, `promotion`, `rollbacks`), and how each decision is signed and verified (`signing`).
Core package: imports nothing from Dagster.

Nothing is imported here: the gate imports `approvals` and `signing`, which import nothing of the gate or
the registry, while `receipts`, `promotion` and `rollbacks` build on both.
"""
