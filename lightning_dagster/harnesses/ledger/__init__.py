"""An accounts agent with a verifiable side effect (a sqlite row) and a destructive tool it must not use."""
