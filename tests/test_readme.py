"""The README and the docs stay honest: the README stays a front door, its test command stays where
.ci/run reads it, every relative link and anchor resolves, and every command and `--flag` they name exists.

A command is `gpt VERB [SUB]`, `python -m gpt.X`, `python train.py` / `sample.py` / `data/prepare.py` (or
`torchrun ... train.py`) in a ```bash block or an inline code span; its flags are checked against that
command's own `--help`. A flag named in prose is checked against every command's `--help` together.
"""

import contextlib
import importlib
import importlib.util
import io
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import ROOT

README = ROOT / "README.md"
DOCS = [README, ROOT / "SECURITY.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = [README, *sorted((ROOT / "docs").glob("*.md"))]  # whose commands and flags must be real
VERBS = ("prepare", "train", "sample", "chat", "serve", "evaluate", "export", "hf", "lora", "plan", "plot")
VERBS += ("attention", "dcp", "pairs")
SUBCOMMANDS = {"hf": ("export", "import"), "lora": ("merge",), "dcp": ("convert",)}
# Flags of other programs that the docs show beside ours (llama.cpp, torchrun, lm-eval, pip, curl).
OTHERS = {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--temp", "--port"}
OTHERS |= {"--cache-type-k", "--cache-type-v", "--model", "--model-args", "--include-path", "--tasks", "--metadata"}
OTHERS |= {"--index-url", "--check"}  # pip, ruff

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
COMMAND = re.compile(
    r"(?:^|(?<=[\s(`]))(?:python3? (?:-m gpt\.(?P<mod>[\w.]+)|(?P<script>[\w./-]+\.py))"
    r"|gpt (?P<verb>[a-z]+)(?: (?P<sub>[a-z]+))?|(?P<bare>train\.py|sample\.py))(?=\s|`|$)"
)
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
    assert lines[i + 2] == "python -m pytest -q"  # .ci/run runs this line


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


def _help(verb: str, sub: str | None = None) -> str:
    """The --help text of `gpt VERB [SUB]` (today's flags of its script or `python -m gpt.X`), or of a script."""
    if verb == "train":
        from gpt.train.config import help_text

        return help_text()
    if verb.endswith(".py") or verb == "prepare":  # a script, run as a user runs it (data/ scripts never import torch)
        script = "data/prepare.py" if verb == "prepare" else verb
        run = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{script} --help failed: {run.stderr[-500:]}"
        return run.stdout
    main = importlib.import_module(f"gpt.cli.{'sample' if verb == 'chat' else verb}").main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([sub, "--help"] if sub else ["--help"])
    return out.getvalue()


def _flags(text: str) -> set[str]:
    return {f.replace("_", "-") for f in FLAG.findall(text)}


def _commands(doc):
    """(verb, sub, flags, where) for each command in a bash block or an inline code span of doc."""
    text = _text(doc)
    pieces = []
    for block in FENCE.findall(text):
        if block.startswith(("```bash", "```sh")):
            joined = re.sub(r"\\\n\s*", " ", block)
            pieces += [re.sub(r"\s#.*", "", line) for line in joined.splitlines()[1:-1]]
    pieces += re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    for piece in pieces:
        for part in re.split(r"&&|\|\|?|;|<|>", piece):
            m = COMMAND.search(part)
            if not m:
                continue
            rest = part[m.end() :]
            if m["mod"]:
                yield ("module", m["mod"], set(), part)
            elif m["script"]:
                name = {"train.py": "train", "sample.py": "sample", "data/prepare.py": "prepare"}.get(m["script"])
                yield (name or m["script"], None, _flags(rest), part)
            elif m["bare"]:
                yield (m["bare"][:-3], None, _flags(rest), part)
            elif m["verb"] in VERBS:
                sub = m["sub"] if m["sub"] in SUBCOMMANDS.get(m["verb"], ()) else None
                yield (m["verb"], sub, _flags(rest), part)


@pytest.fixture(scope="module")
def helps():
    cache = {}

    def get(verb, sub=None):
        if (verb, sub) not in cache:
            cache[(verb, sub)] = _help(verb, sub)
        return cache[(verb, sub)]

    return get


def _known(flag: str, help_flags: set[str]) -> bool:
    return flag in help_flags or flag == "--help" or (flag.startswith("--no-") and "--" + flag[5:] in help_flags)


@pytest.mark.parametrize("doc", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_flag_the_docs_name_exists(doc, helps):
    wrong = []
    for verb, sub, flags, where in _commands(doc):
        if verb == "module":
            if importlib.util.find_spec(sub if sub.startswith("gpt.") else f"gpt.{sub}") is None:
                wrong.append(f"python -m gpt.{sub}: no such module")
            continue
        if verb.endswith(".py") and not (ROOT / verb).exists():
            wrong.append(f"{verb}: no such script")
            continue
        help_flags = _flags(helps(verb, sub))
        wrong += [f"{flag} in `{where.strip()}`" for flag in sorted(flags) if not _known(flag, help_flags)]
    assert not wrong, f"{doc.relative_to(ROOT)} names flags its commands lack: " + "; ".join(wrong)


def test_every_flag_named_in_prose_is_a_flag_of_some_command(helps):
    every = set(OTHERS)
    scripts = {verb for doc in CHECKED for verb, *_ in _commands(doc) if verb.endswith(".py")}
    for verb in [*VERBS, *sorted(scripts)]:
        every |= _flags(helps(verb))
        for sub in SUBCOMMANDS.get(verb, ()):
            every |= _flags(helps(verb, sub))
    wrong = [
        f"{doc.relative_to(ROOT)}: {flag}"
        for doc in CHECKED
        for flag in sorted(_flags(_text(doc)))
        if not _known(flag, every)
    ]
    assert not wrong, "flags no command has: " + ", ".join(wrong)
