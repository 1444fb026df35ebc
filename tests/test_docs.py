"""The docs name only real commands: every command line in a fenced code block of the scanned files (`gpt VERB
...`, `python -m gpt VERB ...`, `python train.py` / `sample.py` / `data/...py` / `bench/...py`, `torchrun ...
train.py`) names a script that exists, and each of its `--flags` is in that command's `--help`. The old form
`python -m gpt.X` is an error too ("write `gpt X`"). All problems are reported at once, as file:line.

The verbs' help comes from their parsers in this process (cheap); other scripts' (data/*/prepare.py, bench/)
from `python SCRIPT --help` in a subprocess, run side by side.
"""

import contextlib
import io
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from conftest import ROOT

from gpt.cli.main import VERBS
from gpt.cli.main import main as gpt_main

# The files scanned: the front door and every page behind it.
DOCS = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the top-level scripts that are a verb's thin door
SCRIPT_VERBS = {"train.py": "train", "sample.py": "sample", "data/prepare.py": "prepare"}
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1", "&>"}


def commands(text: str):
    """(line number, command tokens) for each command in the fenced code blocks of a markdown text: lines
    continued with a backslash joined, a `$ ` prompt and comments dropped, pipes and `&&` split apart."""
    fenced, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        if not pending:
            start = number
            line = re.sub(r"^\s*\$ ", "", line)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole, pending = pending + line, ""
        try:
            lexer = shlex.shlex(whole, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote: words as they stand
            tokens = whole.split("#")[0].split()
        command = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                if command:
                    yield start, command
                command = []
            else:
                command.append(token)


def what_runs(tokens: list[str]):
    """What a command line runs: ("verb", VERB, args), ("script", PATH, args), ("old", module, args) or None."""
    while tokens and re.fullmatch(r"\w+=.*", tokens[0]):  # VAR=value before the command
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "gpt":
        return ("verb", tokens[1] if len(tokens) > 1 else "", tokens[2:])
    if tokens[0] == "torchrun":
        if "-m" in tokens and tokens[tokens.index("-m") + 1 :][:1] == ["gpt"]:  # torchrun ... -m gpt train ...
            at = tokens.index("-m") + 2
            return ("verb", tokens[at] if len(tokens) > at else "", tokens[at + 1 :])
        script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
        return None if script is None else ("script", tokens[script], tokens[script + 1 :])
    if not re.fullmatch(r"(.*/)?python3?(\.\d+)?", tokens[0]):
        return None
    rest = tokens[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        if rest[1] == "gpt":
            return ("verb", rest[2] if len(rest) > 2 else "", rest[3:])
        if rest[1].startswith("gpt.") and rest[1][4:] in VERBS:  # the forwarders `gpt VERB` replaced
            return ("old", rest[1], rest[2:])
        return None
    if rest and re.fullmatch(r"(train|sample)\.py|(data|bench)/.+\.py", rest[0]):
        return ("script", rest[0], rest[1:])
    return None


@cache
def verb_help(*argv: str) -> str:
    """`gpt ARGV --help` in this process: the help text, or "" when there is none."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            gpt_main([*argv, "--help"])
        except SystemExit:  # argparse's --help
            pass
    return out.getvalue()


def script_help(path: str) -> str:
    res = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return res.stdout if res.returncode == 0 else ""


def helps_for(verb: str, args: list[str]) -> str:
    """The verb's help and, for a verb with subcommands (`gpt hf export`), the subcommand's."""
    text = verb_help(verb)
    words = [a for a in args if not a.startswith("-")]
    choices = re.search(r"\{([\w,-]+)\}", text)
    if words and choices and words[0] in choices.group(1).split(","):
        text += verb_help(verb, words[0])
    return text


def has_flag(help_text: str, flag: str) -> bool:
    def named(f):
        return re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text) is not None

    if flag == "--help" or named(flag):  # every command answers --help (train's help does not list it)
        return True
    if "dashes or underscores" in help_text and named(flag.replace("_", "-")):  # train's keys take either
        return True
    return flag.startswith("--no-") and "--no-flag" in help_text and named("--" + flag[5:])  # train's booleans


def problems(paths) -> list[str]:
    found, needs_help = [], []  # needs_help: (where, shown, script, flags) of scripts asked in a subprocess
    for path in paths:
        name = Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else Path(path)
        for number, tokens in commands(Path(path).read_text(encoding="utf-8")):
            runs = what_runs(tokens)
            if runs is None:
                continue
            kind, what, args = runs
            where, shown = f"{name}:{number}", " ".join(tokens)
            flags = sorted({a.split("=", 1)[0] for a in args if a.startswith("--")})
            if kind == "old":
                found.append(f"{where}: `{shown}`: write `gpt {what[4:]}` (`python -m gpt.X` is gone)")
                continue
            if kind == "script":
                if not (ROOT / what).is_file():
                    found.append(f"{where}: `{shown}`: no script {what}")
                    continue
                if what not in SCRIPT_VERBS:
                    needs_help.append((where, shown, what, flags))
                    continue
                what = SCRIPT_VERBS[what]
            if what not in VERBS:
                found.append(f"{where}: `{shown}`: no verb {what!r} (`gpt --help` lists them)")
                continue
            text = helps_for(what, args)
            found += [f"{where}: `{shown}`: {f} is not in `gpt {what} --help`" for f in flags if not has_flag(text, f)]
    with ThreadPoolExecutor(4) as pool:
        scripts = sorted({script for _, _, script, _ in needs_help})
        texts = dict(zip(scripts, pool.map(script_help, scripts)))
    for where, shown, script, flags in needs_help:
        found += [
            f"{where}: `{shown}`: {f} is not in `python {script} --help`"
            for f in flags
            if not has_flag(texts[script], f)
        ]
    return sorted(found, key=lambda p: (p.split(":")[0], int(p.split(":")[1])))


def test_the_docs_name_only_real_scripts_and_flags():
    found = problems(DOCS)
    assert not found, f"{len(found)} problem(s) in the docs' commands:\n" + "\n".join(found)


def test_a_misspelt_flag_an_old_form_and_a_missing_script_are_each_reported(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text(
        "Some prose naming `gpt sample --wrong` outside a code block, which is not checked.\n\n"
        "```bash\n"
        "gpt sample --ckpt out/x --temprature 0.5     # the misspelt flag\n"
        "python -m gpt.serve --ckpt out/x\n"
        "python -m gpt.evals.make_next_line --out x  # a module of the package, not a forwarder\n"
        "python train.py --config sft \\\n"
        "    --max-iters 10 --lr-decay-iter 5\n"
        "python bench/bench_nothing.py --quick\n"
        "gpt smaple --ckpt out/x\n"
        "echo '[]' | gpt chat --ckpt out/x --system hi && gpt hf export --ckpt x --out y --force\n"
        "torchrun --nproc-per-node 2 train.py --data d --no-compile --out_dir o\n"
        "torchrun --standalone --nproc-per-node 8 -m gpt train --data d --fsdp --max-itres 5\n"
        "```\n"
        "```\n"
        "gpt evaluate --ckpt x --blue\n"
        "python train.py --help\n"
        "```\n"
    )
    found = problems([doc])
    assert found == [
        f"{doc}:4: `gpt sample --ckpt out/x --temprature 0.5`: --temprature is not in `gpt sample --help`",
        f"{doc}:5: `python -m gpt.serve --ckpt out/x`: write `gpt serve` (`python -m gpt.X` is gone)",
        f"{doc}:7: `python train.py --config sft --max-iters 10 --lr-decay-iter 5`: --lr-decay-iter is not in "
        "`gpt train --help`",
        f"{doc}:9: `python bench/bench_nothing.py --quick`: no script bench/bench_nothing.py",
        f"{doc}:10: `gpt smaple --ckpt out/x`: no verb 'smaple' (`gpt --help` lists them)",
        f"{doc}:13: `torchrun --standalone --nproc-per-node 8 -m gpt train --data d --fsdp --max-itres 5`: "
        "--max-itres is not in `gpt train --help`",
        f"{doc}:16: `gpt evaluate --ckpt x --blue`: --blue is not in `gpt evaluate --help`",
    ], "\n".join(found)
