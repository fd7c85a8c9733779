"""`python -m lightning_dagster ...` runs the `lightning-dagster` command (the same sub-commands, the same exit
status), for an environment whose scripts folder is not on PATH."""

from __future__ import annotations

import sys

from lightning_dagster.cli import main

if __name__ == "__main__":
    sys.exit(main())
