"""The scripts' shared convention: a user's mistake is one `error: ...` line, never a traceback.

    def main(argv=None) -> int:
        args = parser.parse_args(argv)
        return run_main(lambda: prepare(...).line(), DataError, interrupted=f"{args.out} was left as it was")

Only the exception types a script names are turned into messages (exit 2); anything else is a bug
and keeps its traceback. Ctrl-C prints one line and exits 130.
"""

from __future__ import annotations

import sys
from typing import Callable


def run_main(body: Callable[[], str | None], errors: type | tuple[type, ...], interrupted: str = "") -> int:
    """Run a script's body; print what it returns (if anything) and return the exit status."""
    try:
        message = body()
    except errors as e:
        print(f"error: {e}".replace("\n", "\n  "), file=sys.stderr)  # a multi-problem message stays indented
        return 2
    except KeyboardInterrupt:
        print("error: interrupted" + (f"; {interrupted}" if interrupted else ""), file=sys.stderr)
        return 130
    if message:
        print(message)
    return 0
