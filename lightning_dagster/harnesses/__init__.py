"""Example agents that talk to an OpenAI-compatible endpoint; the helpers beside each may import it."""
