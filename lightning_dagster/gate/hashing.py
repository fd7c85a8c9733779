"""Content hashes and fingerprints: every receipt hash, policy hash and fingerprint goes through the one
canonical serialisation (`lightning_dagster.canonical`), so equal content always hashes equal and any
change shows."""

from lightning_dagster.canonical import canonical_json, content_hash

__all__ = ["canonical_json", "content_hash", "fingerprint"]

# A fingerprint for staleness: the content hash of plain JSON data (evaluator config, tools, ...).
fingerprint = content_hash
