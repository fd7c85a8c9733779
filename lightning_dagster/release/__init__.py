"""Release authorization: who may move `approved-default` and the continual-learning loop, and how each
decision is signed and verified. Core package: imports nothing from Dagster.

- `signing`: the one signed-message format (`signed_message(purpose, fields)`, `PURPOSES`), Ed25519 `sign`
  and `verify`, key pairs and key files, `ActorKey`, `signer`.
- `roles`: the deployment's approvers, pinned in the store; a change of the pin is a signed `roles-pin`.
- `approvals`: what an approval signs and how it verifies (pure; the gate's check 7 runs it).
- `receipts`: approvals on the receipt ledger: `sign_approval`, `approve(registry, receipt, approval)`,
  ingest of a receipt the ledger lacks, verification against the ledger's versions.
- `pauses`: the loop's pause and resume decisions and the signed `loop-resume` (pure).
- `promotion`: `promote(registry, receipt, actor, ...)`.
- `rollbacks`: `sign_rollback(registry, version, ...)`, `rollback(registry, request)`.
- `cli`: `lightning-dagster registry ...`.

Nothing is imported here: the gate imports `approvals` and `signing`, which import nothing of the gate or
the registry, while `receipts`, `promotion` and `rollbacks` build on both.
"""
