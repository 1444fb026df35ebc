"""bench/bench_recipe.py's plumbing: every option's flags are valid train.py flags that change the run, one
real tiny train.py process read back, and the options table / final comparison / markdown on canned runs
(the real benchmark trains for many minutes)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from gpt.train.start import resolve_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4"]


def _load_bench():
    sys.path.insert(0, str(ROOT / "bench"))  # it imports its sibling harness.py
    spec = importlib.util.spec_from_file_location("bench_recipe", ROOT / "bench" / "bench_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _cfg(flags):
    return resolve_run(["--config", bench.TODAY, "--data", "unused", *flags]).cfg.to_dict()


@pytest.mark.parametrize("name", list(bench.OPTIONS))
def test_each_option_is_a_valid_flag_set_that_changes_the_run(name):
    assert _cfg(bench.OPTIONS[name]) != _cfg([])


def test_presets_exist_and_the_combination_holds_every_option():
    today, preset = _cfg([]), resolve_run(["--config", bench.PRESET, "--data", "unused"]).cfg.to_dict()
    assert today != preset
    todo = bench.variants(None)
    assert list(todo) == ["today", *bench.OPTIONS, "all options"] and todo["today"] == []
    assert _cfg(todo["all options"]) == {**today, **{k: v for f in bench.OPTIONS.values() for k, v in _diff(f)}}
    assert list(bench.variants(["relu2"])) == ["today", "relu2"]  # one option: no combination row


def test_the_preset_is_todays_config_plus_the_searched_settings_only():
    """shakespeare_char_fast_cpu's notes (and bench/results/recipe-search.md) measured exactly these changes:
    the same model size, batch, optimizer and evaluation as today's config, 325 steps instead of 400."""
    today = _cfg([])
    preset = resolve_run(["--config", bench.PRESET, "--data", "unused"]).cfg.to_dict()
    assert {k: v for k, v in preset.items() if today[k] != v} == {
        "qk_norm": True,
        "untied_head": True,
        "x0_skip": True,
        "resid_lr": 0.02,
        "warmup_iters": 20,
        "max_iters": 325,
        "lr_decay_iters": 325,
        "eval_interval": 325,
    }


def _diff(flags):
    today, changed = _cfg([]), _cfg(flags)
    return [(k, v) for k, v in changed.items() if today[k] != v]


def test_a_real_tiny_run_is_read_back(tmp_path):
    data = bench.prepare(tmp_path, bpe=False)
    flags = [*TINY, "--max-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--dtype", "float32"]
    run = bench.train(data["char"], tmp_path / "run", flags)
    assert [e[0] for e in run["evals"]] == [2, 4] and all(e[2] > 0 for e in run["evals"])  # val bpb too
    assert 0 < run["seconds_to_last_eval"] <= run["process_seconds"]
    with pytest.raises(SystemExit, match="error: .*train.py"):
        bench.train(data["char"], tmp_path / "bad", ["--n-layer", "nope"])


def _fake_train(calls):
    """Canned runs: val falls 0.1 per 25 steps from 2.2; a run's seconds depend on its config and allocator."""

    def train(data, out, flags, env=None):
        calls.append((out.name, flags, env or {}))
        seconds = 10.0 if bench.PRESET in flags else 20.0 if (env or {}).get("GPT_MALLOC") else 16.0
        evals = [(s, round(2.2 - 0.1 * s / 25, 4), 3.0, seconds) for s in (25, 50, 75, 100)]
        return {"evals": evals, "seconds_to_last_eval": seconds, "process_seconds": seconds + 1, "load_1min": 1.0}

    return train


def test_options_table_interleaves_and_reads_steps_to_target(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench, "train", _fake_train(calls))
    data = {"char": tmp_path / "char", "bpe": tmp_path / "bpe"}
    rows = bench.options_table(data, tmp_path, (1, 2), 0.1, 0.2, quick=True, only=["relu2", "qk_norm"])
    assert [(r["variant"], r["seed"]) for r in rows] == [
        *[("today", 1), ("relu2", 1), ("qk_norm", 1), ("all options", 1)],
        *[("relu2", 2), ("qk_norm", 2), ("all options", 2), ("today", 2)],  # the order rotates
    ]
    assert rows[0]["steps_to_target"] == 100 and rows[0]["bpe_val_bpb_at_budget"] == 3.0  # 2.2 - 0.4 <= 1.88
    search, budget, bpe = calls[:3]
    assert "--eval-interval" in search[1] and budget[1][-2:] == ["--max-minutes", 0.1] and bpe[1][-1] == 0.2
    assert all(c[1][:2] == ["--config", bench.TODAY] for c in calls)
    text = bench.markdown({"cpu": "x", "capability": "AVX2", "native_bf16": False, "mkldnn_bf16": False,
                           "cores": 2, "torch": "t", "load_avg": [1]}, rows, None, (0.1, 0.2))  # fmt: skip
    assert "| relu2 | 100 (100-100) |" in text


def test_final_compares_the_preset_with_todays_default_allocator(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench, "train", _fake_train(calls))
    monkeypatch.setattr(bench, "sample", lambda ckpt: f"sample of {Path(ckpt).name}")
    fin = bench.final({"char": tmp_path}, tmp_path, (1, 2, 3), quick=False, nanogpt=False)
    assert len(calls) == 2 * 3 * 3 and {c[2].get("GPT_CPU_BF16") for c in calls} == {None, "0"}
    for summary in fin["summary"].values():
        assert summary["preset_over_baseline"] == 0.5 and summary["today_tuned_over_baseline"] == 0.8
        assert summary["preset_all_seeds_at_target"] and summary["preset_over_baseline_by_seed"] == [0.5] * 3
    assert set(fin["samples"]) == {"today", "preset"}


def test_a_final_run_keeps_the_options_table_of_an_earlier_run(monkeypatch, tmp_path):
    info = {"cpu": "x", "capability": "AVX2", "native_bf16": False, "mkldnn_bf16": False, "cores": 2, "torch": "t"}
    monkeypatch.setattr(bench.harness, "machine", lambda: dict(info, load_avg=[1]))
    monkeypatch.setattr(bench, "prepare", lambda work, bpe: {"char": work, "bpe": work})
    row = {"variant": "today", "steps_to_target": 375, "val_at_budget": 1.9, "steps_at_budget": 300}
    row.update(bpe_val_bpb_at_budget=2.5, bpe_steps_at_budget=100)
    monkeypatch.setattr(bench, "options_table", lambda *a: [row])
    fin = {"runs": [], "summary": {}, "samples": {"today": "ROMEO: a", "preset": "ROMEO: b"}}
    monkeypatch.setattr(bench, "final", lambda *a: fin)
    out = tmp_path / "recipe"
    bench.main(["--out", str(out), "--budget", "0.3"])
    bench.main(["--out", str(out), "--final"])
    text, saved = out.with_suffix(".md").read_text(), json.loads(out.with_suffix(".json").read_text())
    assert saved["options"] == [row] and saved["final"] == fin and saved["budgets_min"] == [0.3, 0.2]
    assert "| today | 375 (375-375) |" in text and "ROMEO: b" in text
