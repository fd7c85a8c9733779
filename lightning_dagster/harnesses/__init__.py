"""Example agents that talk to an OpenAI-compatible endpoint and know nothing of this project.

Each `<name>/agent.py` imports only the standard library and `openai`; the project-side helpers next to it
(`tasks.py`, `demos.py`, `verify.py`) may import the agent, never the other way round.
"""
