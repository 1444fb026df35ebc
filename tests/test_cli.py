"""The `gpt` command and its verbs; every entry point answers a mistyped command line with one `error: ...` line
and exit code 2."""

import contextlib
import importlib.util
import io
import re
import subprocess
import sys

import pytest
from conftest import ROOT, save_random_lm

from gpt.cli.main import VERBS, main


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train.py", "--max-itres", "3"], "--max-itres: unknown option (did you mean --max-iters?)"),
        (["sample.py", "--ckpt", "x", "--top-k", "many"], "argument --top-k: invalid top-k value: 'many'"),
        (["sample.py"], "the following arguments are required: --ckpt"),
        (["data/prepare.py", "in.txt", "--out", "o", "--tokenizer", "wat"], "invalid choice: 'wat'"),
        (["data/shakespeare_char/prepare.py", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["-m", "gpt", "evaluate", "--ckpt", "x", "--source-file", "s", "--reference", "r", "--beam-size", "two"],
            "argument --beam-size: invalid int value: 'two'",
        ),
        (["-m", "gpt", "hf", "export"], "the following arguments are required: --ckpt, --out"),
    ],
)
def test_a_mistyped_command_line_is_one_line(argv, needle):
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert needle in res.stderr


def help_of(argv) -> tuple[int, str]:
    """`gpt ARGV` in this process: its exit status and what it printed to stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's --help
            code = e.code
    return code, out.getvalue()


def test_gpt_help_lists_every_verb_with_one_line_each():
    verbs = {p.stem for p in (ROOT / "gpt" / "cli").glob("*.py") if "\ndef main(" in p.read_text()} - {"main"}
    assert set(VERBS) == verbs  # a verb module without a listing (or a listing without a module) fails here
    code, out = help_of(["--help"])
    assert code == 0
    for verb, line in VERBS.items():
        assert f"  {verb} " in out and line in out
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, out = help_of([])  # no verb: a mistake, the same listing on stderr and a non-zero status
    assert code == 2 and out == "" and err.getvalue().endswith("\nerror: no verb given: `gpt <verb> ...`\n")
    assert all(f"  {verb} " in err.getvalue() for verb in VERBS)
    # `python -m gpt --help` through gpt/__main__.py, without importing torch or any verb
    res = subprocess.run(
        [sys.executable, "-c", "import runpy, sys; sys.argv = ['gpt', '--help']\ntry:\n"
         "    runpy.run_module('gpt', run_name='__main__')\nexcept SystemExit as e:\n"
         "    print(e.code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('gpt.cli.')))"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert res.stdout.endswith("0 ['gpt.cli.main']\n") and "  serve " in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("verb", list(VERBS))
def test_each_verb_answers_help_as_gpt_verb(verb):
    code, out = help_of([verb, "--help"])
    assert code == 0 and out.startswith(f"usage: gpt {verb} "), out[:200]


def test_an_unknown_verb_is_one_line_with_a_suggestion(capsys):
    assert main(["smaple", "--ckpt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown verb 'smaple' (did you mean `gpt sample`?)") and err.count("\n") == 1
    res = subprocess.run([sys.executable, "-m", "gpt", "frobnicate"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("error: unknown verb 'frobnicate'") and res.stdout == ""


def test_python_m_gpt_sample_runs_a_checkpoint_end_to_end(tmp_path):
    run = save_random_lm(tmp_path / "run", "abc \n")
    res = subprocess.run(
        [sys.executable, "-m", "gpt", "sample", "--ckpt", run, "--prompt", "ab", "--max-new-tokens", "7",
         "--num-samples", "2", "--seed", "1", "--dtype", "float32", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    samples = res.stdout.split("\n---------------\n")
    assert len(samples) == 2 and all(s.startswith("ab") and set(s) <= set("abc \n") for s in samples)
    assert "2 sample(s), 14 tokens" in res.stderr and "seed 1" in res.stderr


@pytest.mark.parametrize("script", ["train.py", "sample.py", "data/prepare.py"])
def test_the_main_jobs_scripts_are_the_verbs_under_their_own_name(script):
    """train.py, sample.py and data/prepare.py run the verbs' mains; their help and hints name the script."""
    res = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith(f"usage: python {script} "), res.stdout[:200] + res.stderr
    res = subprocess.run([sys.executable, script, "--bogus-flag"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    if script != "train.py":  # (train's own check names the flag and the closest real one instead)
        assert f"see python {script} --help" in res.stderr


def test_every_python_name_a_verbs_help_cites_exists():
    """A help text citing `gpt.module.NAME` (where a default comes from) names a module and attribute
    that exist: a renamed module must not leave the help pointing at nothing."""
    for verb in VERBS:
        _, out = help_of([verb, "--help"])
        for name in re.findall(r"\bgpt(?:\.\w+)+", out):
            module, _, attr = name.rpartition(".")
            found = _is_module(name) or (_is_module(module) and hasattr(importlib.import_module(module), attr))
            assert found, f"`gpt {verb} --help` cites {name}, which does not exist"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module (gpt.infer.translate.X): its parent is not a package
        return False
