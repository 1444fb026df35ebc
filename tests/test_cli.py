"""Every entry point answers a mistyped command line with one `error: ...` line and exit code 2."""

import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train.py", "--max-itres", "3"], "--max-itres: unknown option (did you mean --max-iters?)"),
        (["sample.py", "--ckpt", "x", "--top-k", "many"], "argument --top-k: invalid top-k value: 'many'"),
        (["sample.py"], "the following arguments are required: --ckpt"),
        (["data/prepare.py", "in.txt", "--out", "o", "--tokenizer", "wat"], "invalid choice: 'wat'"),
        (["data/shakespeare_char/prepare.py", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["-m", "gpt.evaluate", "--ckpt", "x", "--source-file", "s", "--reference", "r", "--beam-size", "two"],
            "argument --beam-size: invalid int value: 'two'",
        ),
        (["-m", "gpt.hf", "export"], "the following arguments are required: --ckpt, --out"),
    ],
)
def test_a_mistyped_command_line_is_one_line(argv, needle):
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert needle in res.stderr
