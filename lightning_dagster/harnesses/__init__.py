"""Example agents that talk to an OpenAI-compatible endpoint and know nothing of this project: each
`<name>/agent.py` imports only the standard library and `openai`; the helpers beside it may import the agent.
"""
