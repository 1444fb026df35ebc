"""Every measured figure the docs publish comes from a results file under bench/results/, and says so.

A figure in README.md, docs/*.md or bench/README.md is written in one of two ways:

- inline, as a link to the results file whose title says where in it the value is, e.g.
  `[1.18x](bench/results/llamacpp.json "rows[model=gpt2,ours=float32 --compile].ratio")`: the test reads
  that value and fails unless the figure shown is it, rounded to the decimals shown;
- a table copied from a benchmark's own markdown report, under a `<!-- figures: results/NAME.md -->` line:
  every row of the copy must be a row of that report (the benchmark writes the report from its JSON).

Then no other measurement may stand in the prose: a number with a measurement's unit (a ratio `1.3x`,
tokens/s, seconds, ms, %, MB/s, MFU, BLEU ...) outside a figure link, a tied table, a code span or a fenced
block fails `test_no_figure_stands_alone`, unless it is listed in NOT_MEASURED with the reason it is not a
measurement (a limit, a setting, a definition). A rerun that changes a result changes the docs, or CI fails.

The title's little language (`bench/README.md#how-figures-are-tied` documents it for writers):
  path   = key ("." key)*; a key may be followed by selectors [i], [*] or [field=value,...] (list items
           whose fields, as text, equal the values; exactly one must match unless [*] maps over all,
           or [*field=value,...] over those that match)
  expr   = term ((" * " | " / " | " + " | " - ") term)*  (left to right), term = number | path | f(path),
           f one of median, min, max, mean, sum, len (over a list of numbers, e.g. rows[*].seconds);
           a value stored with its unit ("62.1 MiB") counts as its number
"""

import json
import math
import re
import statistics
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "bench" / "results"

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
FIGURE = re.compile(r'\[([^\]]*?)\]\(([^)\s]+\.json) "([^"]+)"\)')
TABLE_MARK = re.compile(r"^<!-- figures: (\S+\.md) -->$")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
FUNCS = {"median": statistics.median, "min": min, "max": max, "mean": statistics.fmean, "sum": sum, "len": len}

# A measurement's unit after a number. `x` only where it is a ratio (not `4x4x128`, `32 x 1024`).
UNIT = re.compile(
    r"(?<![\w.-])~?\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
    r"(?:x(?![\w\d])| ?(?:tok(?:ens)?/s|ms\b|s\b|seconds\b|minutes\b|%|MB/s|TFLOP/s|GFLOP/s|MFU|GiB\b|MiB\b|MB\b|GB\b))"
    r"|\bBLEU \d+\.\d|\bMFU \d"
)


# Numbers with a unit that are not measurements, by document: each a phrase as it is written and why.
NOT_MEASURED: dict[str, dict[str, str]] = {
    "README.md": {
        "the 0.6x we aimed for": "the preset's goal, not a result",
    },
    "bench/README.md": {
        "about 100 and 200 MB": "the sizes of the corpora the benchmark builds (--sizes), settings",
        "(the target: 20%)": "the goal of record-file preparation, not a result",
        "(the issue's bar: >= 40%)": "the goal of the FSDP issue, not a result",
        "blocks of 32 MiB and more": "the allocator's mmap threshold, a setting",
        "(<= 45 s, >= 3x)": "the speedrun's goals, not results",
        "The goal of 1.3x": "the throughput goal, not a result",
        "the goal was 0.6x": "the preset's goal, not a result",
        "(goal: 1%)": "int8's val-loss goal, not a result",
        "the goal of 1.5x": "int8's speed goal, not a result",
        "Goal (32 clients >= 4x": "the serving goal, not a result",
        "within 60 minutes of CPU training": "the translation goal, not a result",
        "H100 80GB HBM3": "the GPU's model name",
        "The goal of 50% MFU": "the GPU training goal, not a result",
        "at least 1.0x at every precision, eager at least 0.8x": "the goal against llama.cpp (issue 43), not a result",
    },
    "docs/chat.md": {
        "5% of the conversations": "the default of --val-fraction",
        "30 minutes at most": "a setting of --config sft (max_minutes)",
    },
    "docs/data.md": {
        "(64 MiB;": "the default of --max-row-bytes",
        "| 64 MiB |": "the default of --max-row-bytes, in the table of options",
        "stream in 1 MiB chunks": "the size of a read (gpt/data), a setting",
        "at least 16 MiB |": "the floor of --max-output-bytes' default, in the table of options",
    },
    "docs/distributed.md": {
        "with 10% of each 80 GB GPU kept": "the planner's headroom and the GPU size it plans for (settings)",
    },
    "docs/evaluation.md": {
        "bits per byte within 1%": "a tolerance tests/test_lmeval.py asserts",
        "bits per byte within 0.5%": "a tolerance tests/test_lmeval.py asserts",
    },
    "docs/sampling.md": {
        "logits fit 1 GiB": "the memory budget of one batch of samples, a limit",
        "4 GiB, least recently used": "the size limit of the compiled-step cache",
        "matrix of >= 2 MiB": "the size from which a float32 matrix is split, a threshold",
        "(+154 MB for GPT-2 124M)": "the size of a 50304 x 768 float32 matrix, arithmetic",
    },
    "docs/training.md": {
        "blocks under 32 MiB": "the allocator's settings (gpt/runtime.py)",
        "past 2 GiB free and grows in 512 MiB steps": "the allocator's settings (gpt/runtime.py)",
        "a gradient norm 10x its recent median": "the health warning's threshold",
        "fits in 90% of the GPU's memory": "the share --batch-size auto may fill, a setting",
    },
}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _key_selectors(key: str):
    m = re.fullmatch(r"([^\[\]]*)((?:\[[^\]]*\])*)", key)
    if not m:
        raise ValueError(f"bad key {key!r}")
    return m.group(1), re.findall(r"\[([^\]]*)\]", m.group(2))


def _select(value, selector: str):
    if selector == "*":
        return list(value)
    if re.fullmatch(r"-?\d+", selector):
        return value[int(selector)]
    wanted = dict(part.split("=", 1) for part in selector.removeprefix("*").split(","))
    found = [v for v in value if all(str(v.get(k)) == want for k, want in wanted.items())]
    if selector.startswith("*"):  # [*field=value]: every match, mapped over
        return found
    if len(found) != 1:
        raise ValueError(f"[{selector}] matches {len(found)} items")
    return found[0]


def resolve(data, path: str):
    """The value at `path` in `data` (a list where a [*] maps over items)."""
    parts = re.findall(r"(?:[^.\[]|\[[^\]]*\])+", path)
    values, mapped = [data], False
    for part in parts:
        name, selectors = _key_selectors(part)
        out = []
        for v in values:
            v = v[name] if name else v
            items = [v]
            for s in selectors:
                many = s.startswith("*")
                items = [y for x in items for y in (_select(x, s) if many else [_select(x, s)])]
                mapped |= many
            out += items
        values = out
    return values if mapped else values[0]


def evaluate(data, expr: str) -> float:
    """The value of a figure's title `expr` over the results `data`."""
    tokens = re.split(r" ([*/+-]) ", expr.strip())
    ops = {"*": lambda a, b: a * b, "/": lambda a, b: a / b, "+": lambda a, b: a + b, "-": lambda a, b: a - b}

    def term(t: str):
        if re.fullmatch(r"-?\d+(\.\d+)?", t):
            return float(t)
        if m := re.fullmatch(r"(\w+)\((.*)\)", t):
            return FUNCS[m.group(1)](resolve(data, m.group(2)))
        value = resolve(data, t)
        return float(value.split()[0]) if isinstance(value, str) else value  # "62.1 MiB": 62.1

    value = term(tokens[0])
    for op, t in zip(tokens[1::2], tokens[2::2]):
        value = ops[op](value, term(t))
    return float(value)


def shown(text: str) -> tuple[float, int]:
    """The number a figure's text shows, and its decimals."""
    m = NUMBER.search(text.replace("**", ""))
    if not m:
        raise ValueError(f"no number in {text!r}")
    digits = m.group().replace(",", "")
    return float(digits), len(digits.partition(".")[2])


def figures(doc: Path):
    for m in FIGURE.finditer(FENCE.sub("", _text(doc))):
        yield m.group(1), (doc.parent / m.group(2)).resolve(), m.group(3)


def tables(doc: Path):
    """(report, rows) for each table under a `<!-- figures: ... -->` line."""
    lines = _text(doc).splitlines()
    for i, line in enumerate(lines):
        if m := TABLE_MARK.match(line.strip()):
            rows = []
            for row in lines[i + 1 :]:
                if not row.startswith("|"):
                    break
                rows.append(row)
            yield (doc.parent / m.group(1)).resolve(), rows


def _cells(row: str) -> tuple[str, ...]:
    return tuple(c.strip().replace("**", "") for c in row.strip().strip("|").split("|"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_is_the_value_in_its_results_file(doc):
    wrong = []
    for text, source, expr in figures(doc):
        where = f"{text!r} ({source.name} {expr!r})"
        if not source.is_relative_to(RESULTS) or not source.is_file():
            wrong.append(f"{where}: not a results file under bench/results/")
            continue
        try:
            value = evaluate(json.loads(source.read_text()), expr)
            number, decimals = shown(text)
        except (KeyError, IndexError, TypeError, ValueError, statistics.StatisticsError) as e:
            wrong.append(f"{where}: {type(e).__name__}: {e}")
            continue
        if not math.isclose(number, value, abs_tol=0.5 * 10**-decimals + 1e-9):
            wrong.append(f"{where}: the results file says {value:.6g}")
    assert not wrong, f"{doc.relative_to(ROOT)}: " + "; ".join(wrong)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tied_table_is_rows_of_its_report(doc):
    wrong = []
    for report, rows in tables(doc):
        if not report.is_relative_to(RESULTS) or not report.is_file():
            wrong.append(f"{report.name}: not a report under bench/results/")
            continue
        theirs = {_cells(r) for r in _text(report).splitlines() if r.startswith("|")}
        wrong += [
            f"row not in {report.name}: {r}" for r in rows if not set(r) <= set("|-: ") and _cells(r) not in theirs
        ]
    assert not wrong, f"{doc.relative_to(ROOT)}: " + "; ".join(wrong)


def untied(doc: Path) -> list[str]:
    """The measurement-like numbers of `doc` that no figure link, tied table or NOT_MEASURED entry covers."""
    text = FENCE.sub("", _text(doc))
    lines, keep, skip = text.splitlines(), [], False
    for line in lines:  # drop tied tables
        if TABLE_MARK.match(line.strip()):
            skip = True
            continue
        if skip and line.startswith("|"):
            continue
        skip = False
        keep.append(line)
    text = FIGURE.sub(" ", "\n".join(keep))
    text = re.sub(r"`[^`]*`", " ", text)  # code spans: commands and settings
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets (anchors hold numbers)
    for phrase in NOT_MEASURED.get(str(doc.relative_to(ROOT)), {}):
        text = text.replace(phrase, " ")
    return [f"{m.group().strip()!r} in {text[max(0, m.start() - 40) : m.end() + 20]!r}" for m in UNIT.finditer(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_figure_stands_alone(doc):
    alone = untied(doc)
    assert not alone, (
        f"{doc.relative_to(ROOT)}: {len(alone)} measured figures not tied to a results file: " + "; ".join(alone[:20])
    )


def test_the_title_language():
    data = {"rows": [{"m": "a", "v": 1.0, "r": [1, 5, 3]}, {"m": "b", "v": 4.0, "r": [2]}], "n": 2}
    assert evaluate(data, "rows[m=b].v / rows[m=a].v") == 4.0
    assert evaluate(data, "median(rows[m=a].r)") == 3
    assert evaluate(data, "max(rows[*].v) * 100") == 400
    assert evaluate(data, "rows[1].v - n") == 2
    assert evaluate({"mem": "62.1 MiB"}, "mem") == 62.1
    assert evaluate(data, "sum(rows[*m=b].v)") == 4.0 and evaluate(data, "len(rows[*m=c].v)") == 0
    with pytest.raises(ValueError):
        evaluate(data, "rows[m=c].v")
    assert shown("**1,047 tok/s**") == (1047.0, 0) and shown("0.70x") == (0.7, 2)
