"""The files `lightning-dagster init` copies into a new project (see `project.scaffold`)."""
