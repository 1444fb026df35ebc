"""lm-evaluation-harness against the server, against the Hugging Face export, and against our own bits per byte:
they agree. CPU, offline (the tasks read local files: gpt/evals), tiny limits.

Tolerances. The server and the export run the same windows (lm-eval's max_length: block_size + 1 through the
API, block_size - 1 with `hf`, so that both score block_size - 1 new tokens per window) and the same ids, so
accuracies are equal; bits per byte differ only by the padded vocabulary: `transformers` normalizes over the
export's 128 rows, the server over the tokenizer's 66 ids (a trained model leaves little mass on the others):
within 1% (0.3% measured). `gpt evaluate --text --stride block_size` scores block_size tokens per window,
lm-eval block_size - 1 (each window's first target with one token of context): within 0.5% (0.1% measured).

Request by request. The server scores over the tokenizer's ids (it cuts the padded rows off before the softmax:
gpt/infer/logprobs.py), so `hf` on an export of the same weights cut to those ids computes the same function:
every request's log-likelihood and is-greedy flag agree, float32 both sides. The same weights, ids and windows
in two implementations whose float32 roundings fall in different orders (matmul blocking, attention kernels,
float32 against float64 sums over a request's tokens): within 1e-5 relative, 80 times the 1.2e-7 measured, about
float32's epsilon (a request sums up to 3000 token log-probabilities). A window shifted by one token, a context
token dropped or the padded rows left in move a request by 1e-3 relative or more.
"""

import dataclasses
import json
from typing import NamedTuple

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra is not installed: pip install -e '.[eval]'")
pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("transformers", reason="the dev extra is not installed: pip install -e '.[dev]'")

from conftest import SHAKESPEARE, one_line_error, save_random_lm  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gpt import load_checkpoint  # noqa: E402
from gpt.checkpoints import native  # noqa: E402
from gpt.cli.evaluate import main as evaluate_main  # noqa: E402
from gpt.evals import TASKS, TASKS_DIR  # noqa: E402
from gpt.evals.make_next_line import OUT, make_items  # noqa: E402
from gpt.infer.perplexity import score_text  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 12


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing here may download: lm-eval, datasets and transformers are told so (before the module's fixtures)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """The end of tiny-shakespeare: text the char model's vocabulary covers (wikitext's digits it does not)."""
    path = tmp_path_factory.mktemp("lmeval") / "tail.txt"
    path.write_bytes(SHAKESPEARE.read_bytes()[-3000:])
    return path


@pytest.fixture(scope="module")
def hf_export(trained_run, tmp_path_factory):
    from gpt.cli.hf import main as hf_main

    out = tmp_path_factory.mktemp("hf") / "export"
    assert hf_main(["export", "--ckpt", str(trained_run), "--out", str(out)]) == 0
    return out


def evaluate(model: str, model_args: dict, text_file, samples: bool = False) -> dict:
    """lm-eval's results for our tasks; with `samples`, (results, each task's per-document samples)."""
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"text_file": str(text_file)})
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(TASKS), task_manager=manager, limit=LIMIT, random_seed=0,
        log_samples=samples,
    )  # fmt: skip
    return (out["results"], out["samples"]) if samples else out["results"]


def scores(samples: dict) -> dict:
    """Each request's response, by (task, document, request): a log-likelihood and is-greedy flag for the
    multiple-choice task's choices, a log-likelihood for the rolling task's text."""
    out = {}
    for task, docs in samples.items():
        for doc in docs:
            for i, (args, resp) in enumerate(zip(doc["arguments"], doc["resps"])):
                out[task, doc["doc_id"], i] = (args, resp[0] if isinstance(resp[0], tuple) else (resp[0], None))
    return out


class Served(NamedTuple):
    results: dict  # lm-eval's, with the server's tokenizer
    with_hf_tokenizer: dict  # with the export's
    scores: dict  # each request's (scores()), with the server's tokenizer
    scores_with_hf_tokenizer: dict


@pytest.fixture(scope="module")
def through_server(trained_run, hf_export, text_file):
    """lm-eval's local-completions on the served checkpoint: with the server's tokenizer, and with the export's."""
    model, tok, meta = load_checkpoint(trained_run)
    with running(create_app(model, tok, meta, ServeConfig(model_name="m", max_batch=8))) as url:
        common = {"model": "m", "base_url": f"{url}/v1/completions", "max_length": 65, "batch_size": 4}
        remote, samples = evaluate("local-completions", {**common, "tokenizer_backend": "remote"}, text_file, True)
        hf_tok = {**common, "tokenizer_backend": "huggingface", "tokenizer": str(hf_export)}
        with_hf_tokenizer, hf_tok_samples = evaluate("local-completions", hf_tok, text_file, True)
    return Served(remote, with_hf_tokenizer, scores(samples), scores(hf_tok_samples))


def test_the_server_scores_as_lm_eval_expects_with_either_tokenizer(through_server):
    remote, with_hf_tokenizer = through_server.results, through_server.with_hf_tokenizer
    mc, text = remote["gpt_shakespeare_next_line"], remote["gpt_wikitext2"]
    assert 0 <= mc["acc,none"] <= 1 and mc["acc_norm,none"] != mc["acc,none"]  # scored, not one constant per item
    assert 2.0 < text["bits_per_byte,none"] < 4.5
    assert text["byte_perplexity,none"] == pytest.approx(2 ** text["bits_per_byte,none"], rel=1e-9)
    assert with_hf_tokenizer == remote  # the same ids, the same requests
    assert through_server.scores_with_hf_tokenizer == through_server.scores  # each request's score too


def test_hf_model_on_the_export_gives_the_same_numbers(through_server, hf_export, text_file):
    remote = through_server.results
    hf = evaluate(
        "hf", {"pretrained": str(hf_export), "max_length": 63, "dtype": "float32", "device": "cpu"}, text_file
    )
    for metric in ("acc,none", "acc_norm,none"):
        assert hf["gpt_shakespeare_next_line"][metric] == remote["gpt_shakespeare_next_line"][metric]
    bpb = remote["gpt_wikitext2"]["bits_per_byte,none"]
    assert hf["gpt_wikitext2"]["bits_per_byte,none"] == pytest.approx(bpb, rel=0.01)


def test_with_the_prefix_cache_every_request_scores_the_same(through_server, trained_run, text_file):
    """The server's prefix cache on (gpt/infer/prefix.py): the choices of a context load its blocks and their kept
    scores, and every request scores as without it: the same ids and windows, float32 prefills of other lengths
    (within 1e-6 relative). lm-eval reads the continuation's positions only, which a choice prefills itself:
    tests/test_prefix_cache.py checks the kept scores of the context's positions."""
    import httpx

    model, tok, meta = load_checkpoint(trained_run)
    with running(create_app(model, tok, meta, ServeConfig(model_name="m", max_batch=8, prefix_cache_mb=64))) as url:
        common = {"model": "m", "base_url": f"{url}/v1/completions", "max_length": 65, "batch_size": 4}
        results, samples = evaluate("local-completions", {**common, "tokenizer_backend": "remote"}, text_file, True)
        stats = httpx.get(url + "/health").json()["prefix_cache"]
    assert stats["hits"] >= 4 and stats["tokens_reused"] >= 4 * 16  # (lm-eval cuts most of these prompts to the
    # 64-token window on the left: then a context's choices start at different tokens and share nothing)
    cached = scores(samples)
    assert cached.keys() == through_server.scores.keys()
    for key, (args, (ll, greedy)) in cached.items():
        plain_args, (plain_ll, plain_greedy) = through_server.scores[key]
        assert args == plain_args and greedy == plain_greedy and ll == pytest.approx(plain_ll, rel=1e-6), key
    assert results == through_server.results


@pytest.fixture(scope="module")
def unpadded(trained_run, tmp_path_factory):
    """The Hugging Face export of trained_run's weights with the padded vocabulary's rows cut off (66 rows for the
    tokenizer's 66 ids): `transformers` then normalizes over the same ids as the server."""
    model, tok, meta = load_checkpoint(trained_run)
    rows = ("transformer.wte.weight", "lm_head.weight")
    state = {k: v[: tok.vocab_size] if k in rows else v for k, v in model.state_dict().items()}
    config = dataclasses.replace(model.config, vocab_size=tok.vocab_size)
    run = tmp_path_factory.mktemp("unpadded") / "run"
    native.save(run / "best.pt", {"model": state}, native.build_meta(config.to_dict(), meta["tokenizer"]))
    from gpt.cli.hf import main as hf_main

    assert hf_main(["export", "--ckpt", str(run), "--out", str(run.parent / "export")]) == 0
    return run.parent / "export"


def test_every_request_scores_the_same_through_the_server_and_hf(through_server, unpadded, text_file):
    served = through_server.scores
    hf_args = {"pretrained": str(unpadded), "max_length": 63, "dtype": "float32", "device": "cpu"}
    hf = scores(evaluate("hf", hf_args, text_file, True)[1])
    assert served.keys() == hf.keys() and len(served) == 4 * LIMIT + 1  # 4 choices per item, 1 rolling text
    for key, (args, (ll, greedy)) in served.items():
        hf_request, (hf_ll, hf_greedy) = hf[key]
        assert args == hf_request, key  # the same request...
        assert ll == pytest.approx(hf_ll, rel=1e-5) and greedy == hf_greedy, (key, ll, hf_ll)  # ...the same score
    assert len({ll for _, (ll, _) in served.values()}) == len(served)  # scored, not one constant


def test_our_bits_per_byte_equals_lm_evals(through_server, trained_run, text_file):
    remote = through_server.results
    model, tok, _ = load_checkpoint(trained_run)
    ours = score_text(model, tok, text_file.read_text(encoding="utf-8"), stride=64, progress=False)
    assert ours["bpb"] == pytest.approx(remote["gpt_wikitext2"]["bits_per_byte,none"], rel=0.005)


def test_gpt_evaluate_lm_eval_serves_runs_and_writes_json(trained_run, text_file, tmp_path, capsys, through_server):
    out = tmp_path / "lm_eval.json"
    argv = ["--ckpt", str(trained_run), "--lm-eval", ",".join(TASKS), "--text", str(text_file), "--limit", str(LIMIT)]
    assert evaluate_main([*argv, "--json", str(out), "--dtype", "float32", "--batch-size", "4"]) == 0
    table = capsys.readouterr().out
    assert "gpt_shakespeare_next_line" in table and "bits_per_byte" in table
    written = json.loads(out.read_text())
    assert written["task"] == "lm-eval" and written["seed"] == 1234 and written["max_length"] == 65
    remote = through_server.results
    for task in TASKS:  # the same numbers as the server driven by hand, to float rounding: the command's model is
        # laid out for CPU decoding (gpt.model.packed: our kernels sum in another order), the fixture's is not
        got = {k: v for k, v in written["results"][task].items() if k != "alias"}
        want = {k: v for k, v in remote[task].items() if k != "alias"}
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), (task, k)


def test_lm_eval_mistakes_are_one_line_errors(trained_run, tmp_path, capsys, monkeypatch):
    base = ["--ckpt", str(trained_run), "--dtype", "float32"]
    msg = one_line_error(capsys, evaluate_main, *base, "--lm-eval", "gpt_wikitext2", "--text", str(tmp_path / "no.txt"))
    assert "gpt_wikitext2: no text file" in msg
    monkeypatch.delenv("GPT_SHARED_DATA", raising=False)
    msg = one_line_error(capsys, evaluate_main, *base, "--lm-eval", "gpt_wikitext2")
    assert "needs a text file: give --text FILE" in msg
    wiki = tmp_path / "digits.txt"
    wiki.write_text("In 1999, 42 <unk> = 7\n", encoding="utf-8")
    msg = one_line_error(capsys, evaluate_main, *base, "--lm-eval", "gpt_wikitext2", "--text", str(wiki))
    assert "not in the char vocabulary" in msg and "cannot encode this text" in msg
    msg = one_line_error(capsys, evaluate_main, *base, "--lm-eval", "gpt_nothing_like_this", "--text", str(wiki))
    assert "unknown lm-eval task 'gpt_nothing_like_this'" in msg
    msg = one_line_error(capsys, evaluate_main, *base, "--lm-eval", "gpt_wikitext2", "--stride", "8")
    assert "--stride: not for --lm-eval" in msg
    msg = one_line_error(
        capsys, evaluate_main, *base, "--lm-eval", "gpt_shakespeare_next_line", "--prefix-cache-mb", "-1"
    )
    assert "--prefix-cache-mb must be an integer >= 0" in msg


def test_gpt_evaluate_runs_the_next_sentence_task_with_its_prefix_cache(tmp_path, capsys):
    """gpt_wikitext2_next_sentence on --text (sentences a char model spells, its context longer than a passage),
    offline and without indexing lm-eval's own tasks; the prefix cache (on by default) changes no result, and
    every context's later choices hit it."""
    lines = [line.strip() for line in SHAKESPEARE.read_text().splitlines()[-1500:] if len(line.strip()) > 25]
    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(" . ".join(lines[i : i + 5]) for i in range(0, len(lines), 5)), encoding="utf-8")
    run = save_random_lm(tmp_path, "".join(sorted(set(text.read_text()))), block_size=4096)
    argv = ["--ckpt", run, "--lm-eval", "gpt_wikitext2_next_sentence", "--text", text, "--limit", 3]
    results = {}
    for mb in (0, 256):
        out = tmp_path / f"{mb}.json"
        assert evaluate_main([str(a) for a in [*argv, "--json", out, "--prefix-cache-mb", mb]]) == 0
        results[mb] = json.loads(out.read_text())
    assert "gpt_wikitext2_next_sentence" in capsys.readouterr().out
    assert results[0]["results"] == results[256]["results"] and results[0]["prefix_cache"] is None
    assert results[256]["prefix_cache"]["hits"] >= 3 * 3  # every context's choices after its first


def test_the_committed_multiple_choice_items_are_the_generators():
    rows = [json.loads(line) for line in OUT.read_text(encoding="utf-8").splitlines()]
    assert rows == make_items(SHAKESPEARE.read_text(encoding="utf-8"))
    assert len(rows) == 300 and OUT.stat().st_size < 200_000
    assert all(len(r["choices"]) == 4 and len(set(r["choices"])) == 4 for r in rows)
    assert {r["label"] for r in rows} == {0, 1, 2, 3}
