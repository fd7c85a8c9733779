"""Release authorization: who may move `approved-default` and the continual-learning loop, and how each
decision is signed and verified. Nothing is imported here: the gate imports the pure `approvals` and
`signing`, while `receipts`, `promotion` and `rollbacks` build on the gate and the registry.
"""
