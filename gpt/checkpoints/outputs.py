"""Where a command may write a path the user names (`gpt lora merge`, `gpt hf export | import`, `gpt export`,
`gpt dcp convert --out`, `gpt attention`, `gpt plot`, `gpt evaluate --output / --json`): checked before any
work, one rule for all.

    check_targets([out / "best.pt"], force=args.force, sources=[adapters, base])
    check_targets([png], force=True)          # a figure: replaced freely, but never a run's own file

- A target that exists already is refused without `--force` (one line naming it).
- A target that would replace what the command reads (`sources`: the checkpoint, a LoRA checkpoint's
  base) is refused even with `--force`: the same file (a hard link included), a file inside a source
  directory (a Hugging Face or DCP checkpoint), or a run file (`RUN_FILES`) of the run directory a source
  file lies in. Merging adapters into their base's run directory would otherwise replace the base, and the
  adapters would no longer load.
- A run directory's own files are never a target, `--force` or not, whichever run the command reads: a
  directory holding `.lock` or `log.jsonl` (every training run writes both first) is a run directory, and
  its `RUN_OWN` names (`.lock`, the checkpoints, the log, config.json, tensorboard/, wandb/, the sharded
  `step-NNNNNN/` directories, and anything inside those directories) are written only by training it.
  A new file in a run directory (an export's model.gguf, an attention map) is allowed; so is `run.png`,
  the figure the trainer itself redraws from log.jsonl with `gpt plot` at each evaluation. config.json
  alone does not mark a run: a Hugging Face directory holds one too, and is re-exported with `--force`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

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
LOCK_FILE = ".lock"  # gpt/train/rundir.py holds it while a trainer runs
RUN_MARKERS = (LOCK_FILE, "log.jsonl")  # a directory holding either is a run directory
RUN_OWN = (*RUN_FILES, LOCK_FILE, "tensorboard", "wandb")  # and its sharded checkpoints: STEP_DIR
STEP_DIR = re.compile(r"step-\d+(\.\d+)?")  # gpt/checkpoints/dcp.py's step-NNNNNN/ (.N: the same step saved again)


class OutputError(UserError, ValueError):
    """An output path a command must not write (it exists, it is what the command reads, or a run's own file)."""


def check_targets(
    targets: Iterable[str | os.PathLike],
    force: bool,
    sources: Iterable[str | os.PathLike] = (),
    flag: str = "--out",
) -> None:
    """Refuse to write `targets` over a source or a run directory's own file (always) or over an existing file
    (without `force`; `force=True` for outputs that are replaced freely, or whose caller checks that itself)."""
    targets = [Path(t) for t in targets]
    for target in targets:
        for source in sources:
            clash = _clash(target, Path(source))
            if clash:
                raise OutputError(
                    f"{flag}: writing {target} would replace {clash}; choose another {flag} (--force does not "
                    f"change this)"
                )
        own = run_file(target)
        if own:
            raise OutputError(
                f"{flag}: {target} {own}, which only training that run writes; choose another {flag} (--force does "
                f"not change this)"
            )
    existing = [t for t in targets if os.path.lexists(t)]
    if existing and not force:
        raise OutputError(f"{existing[0]} exists already: choose another {flag}, or --force to replace it")


def run_file(target: str | os.PathLike) -> str:
    """Which run directory's own file `target` is ("is the run R's own best.pt", "lies inside the run R's own
    tensorboard/"): a `RUN_OWN` name or a step directory of a run directory, or a path inside one; "" if none."""
    where = Path(os.path.realpath(Path(target).parent)) / Path(target).name  # (a link at `target` is replaced)
    for run in where.parents:
        if any(os.path.lexists(run / marker) for marker in RUN_MARKERS):
            own = where.relative_to(run).parts[0]
            if own in RUN_OWN or STEP_DIR.fullmatch(own):
                return (
                    f"is the run {run}'s own {own}"
                    if where.parent == run
                    else f"lies inside the run {run}'s own {own}/"
                )
    return ""


def sources_of(ckpt: str | os.PathLike, base: str | os.PathLike | None = None) -> list[Path]:
    """What loading `ckpt` reads: the checkpoint and, for LoRA adapters, their base (`base` if given), and its
    base in turn. A checkpoint that cannot be read is the loader's to report: it is listed as given."""
    from gpt.checkpoints import adapters, loader  # torch: the rest of this module is for figures too (gpt plot)

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
