"""Where a command may write a checkpoint or an export (`gpt lora merge`, `gpt hf export`,
`gpt export`): checked before any work, one rule for all.

    check_targets([out / "best.pt"], force=args.force, sources=[adapters, base])

- A target that exists already is refused without `--force` (one line naming it).
- A target that would replace what the command reads (`sources`: the checkpoint, a LoRA checkpoint's
  base) is refused even with `--force`: the same file (a hard link included), a file inside a source
  directory (a Hugging Face or DCP checkpoint), or a run file (`RUN_FILES`) of the run directory a source
  file lies in. Merging adapters into their base's run directory would otherwise replace the base, and the
  adapters would no longer load.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from gpt.checkpoints import adapters, loader
from gpt.errors import UserError

# What a run directory holds (train.py writes them; gpt/train/rundir.py removes them on --force).
RUN_FILES = (
    "last.pt",
    "best.pt",
    "log.jsonl",
    "config.json",
    "last.dcp",
    "best.dcp",
)  # .dcp: links (gpt/checkpoints/dcp.py)


class OutputError(UserError, ValueError):
    """An output path a command must not write (it exists, or it is what the command reads)."""


def check_targets(
    targets: Iterable[str | os.PathLike],
    force: bool,
    sources: Iterable[str | os.PathLike],
    flag: str = "--out",
) -> None:
    """Refuse to write `targets` over a source (always) or over an existing file (without `force`)."""
    targets = [Path(t) for t in targets]
    for target in targets:
        for source in sources:
            clash = _clash(target, Path(source))
            if clash:
                raise OutputError(
                    f"{flag}: writing {target} would replace {clash}; choose another {flag} (--force does not "
                    f"change this)"
                )
    existing = [t for t in targets if os.path.lexists(t)]
    if existing and not force:
        raise OutputError(f"{existing[0]} exists already: choose another {flag}, or --force to replace it")


def sources_of(ckpt: str | os.PathLike, base: str | os.PathLike | None = None) -> list[Path]:
    """What loading `ckpt` reads: the checkpoint and, for LoRA adapters, their base (`base` if given), and its
    base in turn. A checkpoint that cannot be read is the loader's to report: it is listed as given."""
    found, path = [Path(ckpt)], Path(ckpt)
    try:
        while len(found) < 16:  # (16: a cycle of bases is the loader's to report)
            here = loader.locate(path)  # what it is, its meta read once
            if here.kind == "hf":
                break
            path = found[-1] = here.path
            if here.kind != "lora":
                break
            lora_meta = here.meta["lora"]
            path = Path(base) if base and len(found) == 1 else adapters.find_base(lora_meta, path)
            if any(os.path.realpath(path) == os.path.realpath(p) for p in found):
                break
            found.append(path)
    except UserError:
        pass
    return found


def _clash(target: Path, source: Path) -> str:
    """What of `source` (a checkpoint file or directory) writing `target` would change; "" if nothing."""
    if not os.path.lexists(source):
        return ""
    where = Path(os.path.realpath(target.parent)) / target.name  # (a link at `target` itself is replaced)
    real = Path(os.path.realpath(source))
    if os.path.lexists(where) and os.path.exists(real) and os.path.samestat(os.lstat(where), os.stat(real)):
        return f"{source}, which this command reads"  # the same file (a hard link to it included)
    if real.is_dir() and where.is_relative_to(real):
        return f"a file of {source}, which this command reads"
    run = real.parent  # a checkpoint file's run: its best.pt, last.pt, ... (a DCP directory's own run may get
    # the single files it converts to: `gpt dcp convert` refuses a newer one itself)
    if (
        real.is_file()
        and where.parent == run
        and where.name in RUN_FILES
        and any(os.path.lexists(run / n) for n in RUN_FILES)
    ):
        return f"a file of the run {run}, which this command reads from"
    return ""
