"""The command line a results file records: the script relative to the repository, its
arguments without ``--out`` (where a run wrote its files does not change what they hold)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def recorded_command() -> str:
    """``python benchmarks/<script>.py <arguments>`` of this process, ``--out`` left out."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPO):
        script = script.relative_to(REPO)
    args: list[str] = []
    skip_value = False
    for arg in sys.argv[1:]:
        if skip_value:
            skip_value = False
        elif arg == "--out":
            skip_value = True
        elif not arg.startswith("--out="):
            args.append(arg)
    return "python " + shlex.join([str(script), *args])
