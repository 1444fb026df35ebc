"""Messages name real commands: every command line in a string of gpt/ (error messages, hints, help texts,
docstrings) and in every verb's `--help` is one that runs outside a checkout.

- `gpt VERB [SUB]`: VERB is one of gpt.cli.main.VERBS and, for a verb with subcommands (`gpt hf export`,
  `gpt lora merge`), SUB one of them; each `--flag` is in that command's `--help`.
- `python -m MODULE`: MODULE can be imported (`python -m gpt.export` is gone: `gpt export`).
- `python X.py`: never in a message or `--help` (the scripts exist only in a checkout; `gpt VERB` runs
  wherever the package is installed). A docstring may name one that exists in the checkout (train.py is
  `gpt train`'s thin script, data/multi30k/prepare.py a recipe).

A command is found where it starts a line (after its indentation, a `$ ` prompt or a `# ` comment mark), or
opens a `code span`; prose such as "a gpt checkpoint" is not one. `{...}` (an f-string's field) and
CAPITALS or <angle brackets> stand for values.
"""

import ast
import importlib.util
import re
import shlex

import pytest
from conftest import ROOT
from test_docs import SCRIPT_VERBS, has_flag, verb_help

from gpt.cli.main import VERBS

GPT = ROOT / "gpt"
SCRIPT = re.compile(r"(?<![\w/.-])([\w-]+\.py)\b")
COMMAND = re.compile(r"(?:^[ \t]*(?:\$ |# )?|`)((?:gpt|python3?) [^`\n]*)", re.MULTILINE)


def strings(source: str) -> list[tuple[int, str, bool]]:
    """(line, text, is_docstring) for every string literal of a module: an f-string with `{}` for each field."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found, inside = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            found.append((node.lineno, "".join(map(str, parts)), False))
            inside.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside:
            found.append((node.lineno, node.value, id(node) in docstrings))
    return found


def is_value(word: str) -> bool:
    """A placeholder, not a literal word: `{}`, VERB, <verb>, [SUB], ..."""
    return bool(re.search(r"[{}<>\[\]]|\.\.\.", word)) or word.isupper()


def words_of(command: str) -> list[str]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote: words as they stand
        words = command.split()
    cut = next((i for i, w in enumerate(words) if w in {"|", "||", "&&", ";", ">", "2>&1"}), len(words))
    return words[:cut]


def subcommands(verb: str) -> set[str]:
    """The verb's subcommands (or its positional's choices: `gpt lora merge`), from its usage: a `{a,b}` that
    follows no option (`[--tokenizer {bpe,char,gpt2}]` is an option's)."""
    words = verb_help(verb).split("\n\n")[0].split()
    for before, word in zip(["", *words], words):
        choices = re.fullmatch(r"\[?\{([\w,-]+)\}\]?(\s*\.\.\.)?", word)
        if choices and not (before.lstrip("[").startswith("-") and not before.endswith("]")):
            return set(choices.group(1).split(","))
    return set()


def problems_of(command: str, docstring: bool) -> list[str]:
    """What is wrong with one command line (an empty list when it runs)."""
    words = words_of(command)
    if len(words) < 2:
        return []
    if words[0] == "gpt":
        verb = words[1]
        if verb.startswith("-") or is_value(verb):
            return []
        if verb not in VERBS:
            return [f"no verb {verb!r}"]
        args = words[2:]
        if "--" in args:  # what follows `--` is passed on (gpt sweep: `gpt train`'s options), not the verb's
            args = args[: args.index("--")]
        subs = subcommands(verb)
        if subs and args and not args[0].startswith("-") and not is_value(args[0]) and args[0] not in subs:
            return [f"`gpt {verb}` has no subcommand {args[0]!r} (it has {', '.join(sorted(subs))})"]
        text = verb_help(verb) + (verb_help(verb, args[0]) if subs and args else "")
        flags = {a.split("=", 1)[0] for a in args if re.fullmatch(r"--[a-z][\w-]*(=.*)?", a)}
        return [f"{flag} is not in `gpt {verb} --help`" for flag in sorted(flags) if not has_flag(text, flag)]
    if words[1] == "-m":
        module = words[2] if len(words) > 2 else ""
        if not module or is_value(module):
            return []
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            hint = f" (write `gpt {module[4:]}`)" if module.startswith("gpt.") and module[4:] in VERBS else ""
            return [f"no module {module}{hint}"]
        return []
    if words[1].endswith(".py"):
        script = words[1]
        if not docstring:
            return [f"`python {script}` runs only in a checkout: name the `gpt` verb"]
        if not is_value(script) and not (ROOT / script).is_file():
            return [f"no script {script}"]
    return []


def script_problem(name: str) -> str | None:
    """What is wrong with a message naming the script `name` (train.py) in prose, if anything."""
    if (ROOT / name).is_file():
        verb = SCRIPT_VERBS.get(name)
        return f"{name} is in a checkout only: name `gpt {verb}`" if verb else f"{name} is in a checkout only"
    if not any(GPT.rglob(name)):
        return f"no {name}"
    return None


def problems_in(text: str, docstring: bool) -> list[tuple[int, str, str]]:
    """(line within `text`, command, problem) for each problem of each command in `text`, and, outside
    docstrings, of each top-level script it names in prose ("a run that train.py wrote")."""
    found = [
        (text.count("\n", 0, m.start(1)), m.group(1).strip(), problem)
        for m in COMMAND.finditer(text)
        for problem in problems_of(m.group(1).strip(), docstring)
    ]
    if not docstring:
        for m in SCRIPT.finditer(text):
            problem = script_problem(m.group(1))
            if problem and not any(m.group(1) in c for _, c, _ in found):
                found.append((text.count("\n", 0, m.start(1)), m.group(1), problem))
    return found


def help_texts() -> dict[str, str]:
    """`gpt --help`, and `gpt VERB [SUB] --help` for every verb and subcommand."""
    from gpt.cli.main import usage

    texts = {"gpt --help": usage()}
    for verb in VERBS:
        texts[f"gpt {verb} --help"] = verb_help(verb)
        for sub in sorted(subcommands(verb)):
            texts[f"gpt {verb} {sub} --help"] = verb_help(verb, sub)
    return texts


def test_the_check_finds_each_kind_of_wrong_command():
    wrong = {
        "run `python train.py --out-dir OUT` first": "`python train.py` runs only in a checkout: name the `gpt` verb",
        "export it with `python -m gpt.export --format onnx`": "no module gpt.export (write `gpt export`)",
        "`gpt smaple --ckpt out/x`": "no verb 'smaple'",
        "merge with `gpt lora marge --ckpt X`": "`gpt lora` has no subcommand 'marge' (it has merge)",
        "`gpt hf exprot --ckpt X`": "`gpt hf` has no subcommand 'exprot' (it has export, import)",
        "    gpt sample --ckpt out/x --temprature 0.5\n": "--temprature is not in `gpt sample --help`",
    }
    for text, problem in wrong.items():
        assert [p for _, _, p in problems_in(text, docstring=False)] == [problem], text
    assert problems_in("    python data/nowhere/prepare.py --out x\n", docstring=True)[0][2] == (
        "no script data/nowhere/prepare.py"
    )
    right = [
        "sample with `gpt sample --ckpt {}`",
        "a gpt checkpoint, as gpt reads it",
        "`gpt {} --help` lists a verb's options",
        "usage: gpt <verb> [options]      (or: python -m gpt <verb> [options])",
        "`gpt hf export --ckpt out/x --out hf/x`, `gpt lora merge --ckpt X --out Y`",
        "`python -m gpt.evals.make_next_line CORPUS`",
    ]
    for text in right:
        assert problems_in(text, docstring=False) == [], text
    assert problems_in("    python data/multi30k/prepare.py --tokenizer char\n", docstring=True) == []


def test_every_string_in_gpt_names_only_real_commands():
    found = []
    for path in sorted(GPT.rglob("*.py")):
        for line, text, docstring in strings(path.read_text(encoding="utf-8")):
            found += [f"{path.relative_to(ROOT)}:{line + n}: `{c}`: {p}" for n, c, p in problems_in(text, docstring)]
    assert not found, f"{len(found)} command(s) that do not run:\n" + "\n".join(found)


@pytest.mark.parametrize("verb", [None, *VERBS])
def test_every_help_names_only_real_commands(verb):
    texts = {k: v for k, v in help_texts().items() if verb is None and k == "gpt --help" or f"gpt {verb} " in k}
    assert texts and all(texts.values())
    found = [f"`{where}`: `{c}`: {p}" for where, text in texts.items() for _, c, p in problems_in(text, False)]
    assert not found, "\n".join(found)


POINTER = re.compile(r'bench/README\.md,? "([^"]+)"')


def bench_sections() -> list[str]:
    text = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("## ")]


def test_every_pointer_to_bench_readme_names_a_section():
    """Measured figures live in bench/README.md; gpt/ points at them as `bench/README.md, "Section"` (the
    heading's words, without its script), in strings and comments alike."""
    sections, found, wrong = bench_sections(), 0, []
    for path in sorted(GPT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        comments = " ".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)
        for text in [comments, *(t for _, t, _ in strings(source))]:
            for name in POINTER.findall(re.sub(r"\s*\n\s*(# )?", " ", text)):
                found += 1
                if not any(s.startswith(name) for s in sections):
                    wrong.append(f"{path.relative_to(ROOT)}: no section {name!r} in bench/README.md")
    assert found >= 10 and not wrong, wrong
