"""Preference data and training (issue 48): `gpt prepare --preferences` (TRL's and Anthropic HH's rows, the chat
template, bad rows, long pairs) then `gpt train --objective dpo | orpo` end to end, exact resume, LoRA, FSDP,
and the one-line refusals. The losses' parity with TRL is tests/test_prefer_trl.py."""

import json
import math

import pytest
import torch
from conftest import one_line_error, torchrun, train_run, train_script, write_jsonl

from gpt.checkpoints import native
from gpt.cli.prepare import main as prepare_main
from gpt.data.chat import ChatError, ChatTemplate
from gpt.data.preference_batches import PreferenceBatches, batch, open_preferences
from gpt.data.preferences import Pair, fit, preference
from gpt.data.tokenizer import CharTokenizer
from gpt.model.transformer import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\nHA"
WORDS = "the cat sat on a mat dog ran far away and then came back home".split()
TINY = ["--batch-size", "2", "--eval-iters", "2", "--log-interval", "1", "--warmup-iters", "1", "--device", "cpu"]
TINY += ["--dtype", "float32", "--learning-rate", "1e-2", "--no-plot"]


def rows(n, messages=False):
    """`n` pairs: a prompt of words, the chosen answer repeats it, the rejected is short."""
    out = []
    for i in range(n):
        p = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4))
        prompt = [{"role": "user", "content": p}] if messages else p
        chosen = {"role": "assistant", "content": f"yes, {p}"} if messages or i % 2 else f"yes, {p}"
        out.append({"prompt": prompt, "chosen": chosen, "rejected": [{"role": "assistant", "content": "no"}]})
    return out


def log(out, kind="train"):
    return [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r["kind"] == kind]


def random_lm(path, chars, block=64):
    """A run directory holding best.pt: a random 1-layer char model over `chars`."""
    tok = CharTokenizer("".join(sorted(chars)))
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=block, n_layer=1, n_head=2, n_embd=16)
    native.save(path / "best.pt", {"model": GPT(cfg).state_dict()}, native.build_meta(cfg.to_dict(), tok.spec))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random char model (run directory) over CHARS, a window of 64."""
    return random_lm(tmp_path_factory.mktemp("pref_base") / "base", CHARS)


@pytest.fixture(scope="module")
def prefs(base, tmp_path_factory):
    """20 plain-text pairs, prepared with `gpt prepare --preferences` (every 20th to val)."""
    d = tmp_path_factory.mktemp("prefs")
    write_jsonl(d / "pairs.jsonl", rows(20))
    argv = ["--preferences", d / "pairs.jsonl", "--out", d / "data", "--tokenizer-from", base, "--block-size", "32"]
    assert prepare_main([str(a) for a in [*argv, "--quiet", "--long", "truncate"]]) == 0
    return d / "data"


# ---- the rows and the dataset ----------------------------------------------------------------------------


def test_the_row_shapes_of_trl_and_anthropic_hh():
    msgs = [{"role": "user", "content": "hi"}]
    assert preference({"prompt": "p", "chosen": "c", "rejected": "r"}) == Pair("p", "c", "r")
    assert preference({"prompt": msgs, "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"}) == Pair(
        msgs, "c", "r"
    )
    implicit = {
        "chosen": [*msgs, {"role": "assistant", "content": "yes"}],
        "rejected": [*msgs, {"role": "assistant", "content": "no"}],
    }
    assert preference(implicit) == Pair(msgs, "yes", "no")
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello there", "rejected": "\n\nHuman: hi\n\nAssistant: help"}
    assert preference(hh) == Pair("\n\nHuman: hi\n\nAssistant:", " hello there", " help")  # not cut inside "hel"
    for bad, says in [
        ({"prompt": "p", "chosen": "c"}, "lacks 'rejected'"),
        ({"prompt": "p", "chosen": "", "rejected": "r"}, "'chosen' is empty"),
        ({"prompt": "p", "chosen": {"role": "user", "content": "c"}, "rejected": "r"}, "the assistant's"),
        ({"prompt": 3, "chosen": "c", "rejected": "r"}, "'prompt' is int"),
        ([1, 2], "not an object"),
    ]:
        with pytest.raises(ChatError, match=says):
            preference(bad)


def test_long_pairs_lose_the_start_of_their_prompt_or_are_skipped():
    assert fit([1, 2, 3], [4, 5], [6], 4, "truncate") == ([1, 2, 3], None)  # 5 tokens: a window of 4 + 1
    assert fit([1, 2, 3, 4], [5, 6], [7], 4, "truncate") == ([2, 3, 4], "truncated")
    assert fit([1, 2, 3, 4], [5, 6], [7], 4, "skip") == (None, "skipped")
    assert fit([1], [2, 3, 4, 5, 6], [7], 4, "truncate") == (None, "skipped")  # the answer fills the window


def test_prepared_pairs_are_the_chat_templates_rendering_and_batches_mask_the_answers(base, tmp_path, capsys):
    write_jsonl(tmp_path / "m.jsonl", rows(20, messages=True))
    argv = ["--preferences", tmp_path / "m.jsonl", "--out", tmp_path / "d", "--tokenizer-from", base, "--quiet"]
    assert prepare_main([str(a) for a in argv]) == 0
    assert "20 preference pairs (train 19, val 1) through the chat template" in capsys.readouterr().out
    ds = open_preferences(tmp_path / "d")
    template = ChatTemplate()
    tok = template.tokenizer(CharTokenizer("".join(sorted(CHARS))))
    row = rows(20, messages=True)[0]
    for side, answer in ((0, row["chosen"]["content"]), (1, "no")):
        ids, mask = ds.sequence("train", side)
        conversation = [*row["prompt"], {"role": "assistant", "content": answer}]
        assert (ids.tolist(), mask.astype(int).tolist()) == template.render(conversation, tok)
    x, y, z, ids = batch(ds, "train", [0, 3])
    assert ids.tolist() == [0, 3] and batch(ds, "val", [0])[3].tolist() == [19]  # numbered over both splits
    assert x.shape == y.shape == z.shape and x.shape[0] == 4
    (c, cm), (r, rm) = ds.sequence("train", 6), ds.sequence("train", 7)  # pair 3: rows 1 (chosen) and 3
    assert y[3, : len(r) - 1].tolist() == [t if m else -1 for t, m in zip(r[1:], rm[1:])]
    assert y[1, : len(c) - 1].tolist() == [t if m else -1 for t, m in zip(c[1:], cm[1:])]
    assert (y[1, len(c) - 1 :] == -1).all() and (z[1, len(c) - 1 :] == -1).all()  # padding is never a target
    assert z[3, : len(r) - 1].tolist() == r[1:].tolist() and x[3, : len(r) - 1].tolist() == r[:-1].tolist()
    one = PreferenceBatches(ds, "train", 2, seed=5, grad_accum=2, world_size=2, rank=1)
    again = PreferenceBatches(ds, "train", 2, seed=5, grad_accum=2, world_size=2, rank=1)
    assert all(torch.equal(a, b) for a, b in zip(one.get(7, 1), again.get(7, 1)))  # a pure function of the step


def test_bad_rows_name_file_and_row_or_are_skipped_and_counted(base, tmp_path, capsys):
    good = rows(20)
    lines = [
        *good[:3],
        "{not json",
        {"prompt": "p", "chosen": "c"},
        {"prompt": "p", "chosen": "\u00e9", "rejected": "r"},
    ]
    write_jsonl(tmp_path / "bad.jsonl", [*lines, *good[3:]])
    argv = ["--preferences", tmp_path / "bad.jsonl", "--out", tmp_path / "d", "--tokenizer-from", base, "--quiet"]
    err = one_line_error(capsys, prepare_main, *argv)
    assert f"{tmp_path / 'bad.jsonl'}, row 4: not JSON" in err
    assert prepare_main([str(a) for a in [*argv, "--skip-bad-rows"]]) == 0
    captured = capsys.readouterr()
    assert "row 5: the row lacks 'rejected'" in captured.err and "row 6: 'chosen' holds 'é'" in captured.err
    assert "20 preference pairs" in captured.out and "3 bad rows skipped" in captured.out
    err = one_line_error(
        capsys, prepare_main, *argv, "--skip-bad-rows", "--block-size", "8", "--long", "skip", "--force"
    )
    assert "no train pair to write" in err and "too long" in err
    assert prepare_main([str(a) for a in [*argv, "--skip-bad-rows", "--block-size", "28", "--force"]]) == 0
    assert "longer than the block with their prompt's start cut" in capsys.readouterr().out
    err = one_line_error(capsys, prepare_main, *argv, "--seed", "3")
    assert "--seed is for --pairs and --chat datasets, not --preferences" in err


# ---- training ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_training_runs_end_to_end_logs_trls_figures_and_resumes_exactly(objective, base, prefs, tmp_path):
    common = ["--objective", objective, "--init-from", base, "--data", prefs, *TINY, "--eval-interval", "2"]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "4")
    train = log(tmp_path / "full")
    names = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"}
    names |= {"nll_loss", "log_odds_ratio", "log_odds_chosen"} if objective == "orpo" else set()
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(names <= set(r) for r in train)
    assert all(0 <= r["rewards/accuracies"] <= 1 for r in train)
    if objective == "dpo":  # the reference is the policy at step 1: every log-ratio 0, the loss log 2
        assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and train[0]["rewards/margins"] == 0
        assert train[-1]["rewards/margins"] > 0  # and then the policy moves towards the chosen answers
        saved = json.loads((tmp_path / "full" / "config.json").read_text())["train"]
        assert saved["reference"] == str(base)  # recorded: a resume reloads it
    evals = log(tmp_path / "full", "eval")
    assert "val_rewards/accuracies" in evals[-1] and "train_rewards/margins" in evals[-1]
    train_run(*common, "--out-dir", tmp_path / "split", "--max-iters", "2")
    train_run("--resume", tmp_path / "split", "--max-iters", "4")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in log(tmp_path / "split")] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in train
    ]  # bit for bit


def test_a_cached_reference_gives_the_runs_losses(base, prefs, tmp_path, capsys):
    common = ["--objective", "dpo", "--init-from", base, "--data", prefs, *TINY, "--eval-interval", "2"]
    train_run(*common, "--out-dir", tmp_path / "live", "--max-iters", "3")
    train_run(*common, "--out-dir", tmp_path / "cached", "--max-iters", "2", "--reference-cache")
    cache = torch.load(tmp_path / "cached" / "reference_logps.pt", weights_only=True)
    assert cache["logps"].shape == (20, 2) and cache["key"]["reference"] == str(base)
    capsys.readouterr()
    written = (tmp_path / "cached" / "reference_logps.pt").stat().st_mtime_ns
    train_run("--resume", tmp_path / "cached", "--max-iters", "3")
    assert (tmp_path / "cached" / "reference_logps.pt").stat().st_mtime_ns == written  # read back, not recomputed
    assert "the reference's log-probs of 20 pairs cached" in capsys.readouterr().out
    live, cached = log(tmp_path / "live"), log(tmp_path / "cached")
    assert [r["step"] for r in cached] == [1, 2, 3]
    for a, b in zip(live, cached):
        for k in ("loss", "grad_norm", "rewards/margins", "rewards/chosen"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    err = one_line_error(capsys, train_script.main, *common, "--out-dir", tmp_path / "o", "--objective", "orpo",
                         "--reference-cache")  # fmt: skip
    assert "--reference-cache: does nothing with --objective orpo" in err


def test_lora_dpo_trains_only_the_adapters_against_the_base(base, prefs, tmp_path):
    out = tmp_path / "lora"
    common = ["--objective", "dpo", "--init-from", base, "--data", prefs, *TINY, "--lora-rank", "2"]
    train_run(*common, "--out-dir", out, "--max-iters", "3", "--eval-interval", "3", "--plot")
    train = log(out)
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and train[-1]["loss"] < math.log(2)
    saved = torch.load(out / "last.pt", weights_only=True)
    assert "lora" in saved["meta"] and all("lora" in k for k in saved["model"])  # only the adapters
    assert (out / "run.png").is_file()  # the live plot draws a preference run


def test_fsdp_dpo_is_the_one_process_run(base, prefs, tmp_path):
    """Two processes, each its half of the global batch and its own reference forwards: the losses equal one
    process's with the same global batch to rel 1e-5 (float32, gradients summed in another order)."""
    common = ["--objective", "dpo", "--init-from", base, "--data", prefs, *TINY, "--grad-accum", "2"]
    common += ["--max-iters", "2", "--eval-interval", "2", "--grad-clip", "0"]
    torchrun(2, *common, "--out-dir", tmp_path / "fsdp", "--fsdp")
    train_run(*common, "--out-dir", tmp_path / "one")
    ours, one = log(tmp_path / "fsdp"), log(tmp_path / "one")
    assert [r["step"] for r in ours] == [1, 2]
    for a, b in zip(ours, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-7)


def test_mistakes_are_one_line(base, prefs, tiny_char_data, tmp_path, capsys):
    run = ["--data", prefs, "--out-dir", tmp_path / "r", *TINY, "--max-iters", "1"]
    other = random_lm(tmp_path / "other", "abc")
    err = one_line_error(
        capsys, train_script.main, *run, "--objective", "dpo", "--init-from", base, "--reference", other
    )
    assert f"--reference {other}" in err and "tokenizer" in err
    err = one_line_error(capsys, train_script.main, *run, "--objective", "orpo", "--init-from", base, "--beta", "0.2")
    assert "--beta: does nothing with --objective orpo; it is for --objective dpo | grpo" in err
    err = one_line_error(
        capsys, train_script.main, *run, "--objective", "dpo", "--orpo-lambda", "0.3", "--init-from", base
    )
    assert "--orpo-lambda: does nothing with --objective dpo" in err
    err = one_line_error(capsys, train_script.main, *run, "--beta", "0.2")
    assert "--beta: does nothing with --objective lm" in err
    err = one_line_error(capsys, train_script.main, *run, "--objective", "grpo", "--init-from", base)
    assert "--objective grpo: needs --reward" in err
    err = one_line_error(capsys, train_script.main, *run, "--objective", "dpo")
    assert "needs a reference model" in err
    err = one_line_error(capsys, train_script.main, *run, "--init-from", base)
    assert "holds preference pairs: train on them with --objective dpo or --objective orpo" in err
    lm = ["--data", tiny_char_data, "--out-dir", tmp_path / "lm", *TINY, "--max-iters", "1"]
    err = one_line_error(capsys, train_script.main, *lm, "--objective", "orpo")
    assert "is not a preference dataset" in err
