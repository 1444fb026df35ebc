"""The README and the docs stay honest: the README stays a front door, its test command stays where
.ci/run reads it, every relative link and anchor resolves, and every `--flag` they name exists.

Commands in code blocks are checked against their own `--help` by tests/test_docs.py; a flag named in prose
is checked here against every command's `--help` together.
"""

import re
from collections.abc import Iterator

import pytest
from conftest import ROOT
from test_docs import commands, script_help, verb_help, what_runs

from gpt.cli.main import VERBS

README = ROOT / "README.md"
DOCS = [README, ROOT / "SECURITY.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = [README, *sorted((ROOT / "docs").glob("*.md"))]  # whose prose flags must be real
# Flags of other programs that the docs show beside ours (llama.cpp, torchrun, lm-eval, pip, curl).
OTHERS = {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--temp", "--port"}
OTHERS |= {"--cache-type-k", "--cache-type-v", "--model", "--model-args", "--include-path", "--tasks", "--metadata"}
OTHERS |= {"--index-url", "--check", "--maxprocesses"}  # pip, ruff, pytest-xdist
OTHERS |= {"--build", "--build-arg", "--network", "--name", "--iptables", "--from-literal"}  # docker, dockerd, kubectl
OTHERS |= {"--no-install-recommends", "--variant"}  # apt-get, debootstrap

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
FLAG = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*")


def _text(path):
    return path.read_text(encoding="utf-8")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces as dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path) -> Iterator[str]:
    seen: dict[str, int] = {}
    for line in FENCE.sub("", _text(path)).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            yield slug if n == 0 else f"{slug}-{n}"


def test_the_readme_is_a_front_door_with_the_test_command_where_ci_reads_it():
    lines = _text(README).splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    marks = [i for i, line in enumerate(lines) if line.startswith("<!-- test-command")]
    assert len(marks) == 1, "README.md needs exactly one <!-- test-command --> marker"
    i = marks[0]
    assert lines[i + 1] == "```bash" and lines[i + 3] == "```", "the marker must be followed by a ```bash fence"
    assert lines[i + 2] == "python -m pytest -q -n auto --maxprocesses 4"  # .ci/run runs this line


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", _text(doc))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in set(_anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def _flags(text: str) -> set[str]:
    return {f.replace("_", "-") for f in FLAG.findall(text)}


def test_every_flag_named_in_prose_is_a_flag_of_some_command():
    """A `--flag` in running text belongs to some command (the commands in code blocks: tests/test_docs.py)."""
    every = set(OTHERS)
    for verb in VERBS:
        text = verb_help(verb)
        every |= _flags(text)
        choices = re.search(r"\{([\w,-]+)\}", text)  # subcommands: `gpt hf export`, `gpt lora merge`
        for sub in choices.group(1).split(",") if choices else ():
            every |= _flags(verb_help(verb, sub))
    scripts = {runs[1] for doc in CHECKED for _, tokens in commands(_text(doc)) if (runs := what_runs(tokens))}
    for script in sorted(s for s in scripts if s.endswith(".py") and (ROOT / s).is_file()):
        every |= _flags(script_help(script))
    wrong = [
        f"{doc.relative_to(ROOT)}: {flag}"
        for doc in CHECKED
        for flag in sorted(_flags(_text(doc)))
        if not (flag in every or (flag.startswith("--no-") and "--" + flag[5:] in every))
    ]
    assert not wrong, "flags no command has: " + ", ".join(wrong)
