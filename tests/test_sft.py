"""Chat fine-tuning: chat files -> a masked, packed dataset -> a model trained on the assistant's tokens."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CHAT_TRAIN as TINY
from conftest import ROOT, chat_rows, prepare, train_run, write_jsonl

from gpt.checkpoints import loader
from gpt.data.format import DataError
from gpt.data.packing import PackedBatches, batch, open_chat_dataset
from gpt.data.sft import prepare_chat
from gpt.data.tokenizer import get_tokenizer
from gpt.data.vocab import dataset_spec
from gpt.model.transformer import GPT, GPTConfig


def prepare_cli(*args):
    r = subprocess.run([sys.executable, "data/prepare.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def test_template_and_mask_on_the_prepared_data(chat_data):
    ds = open_chat_dataset(chat_data)
    tok = get_tokenizer(dataset_spec(chat_data).spec)
    rows = chat_rows(260, short=True)
    assert ds.conversations("train") == 260 and ds.conversations("val") == 40
    for i in (0, 17, 259):
        ids, mask = ds.conversation("train", i)
        user, answer = (m["content"] for m in rows[i]["messages"])
        assert tok.decode(ids) == f"<|user|>{user}<|end|><|assistant|>{answer}<|end|>"
        assert tok.decode(ids[mask]) == f"{answer}<|end|>"  # the loss's targets: exactly the assistant's
        assert mask[: len(tok.encode(user)) + 3].sum() == 0  # markers and the user's words are context


def test_row_formats_and_bad_rows(base_data, tmp_path):
    rows = [
        {"prompt": "Hallo", "completion": "Hello"},
        "{not json",
        {"instruction": "Translate", "input": "Katze", "output": "cat"},
        {"question": "no format"},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hund"}]},
    ] + chat_rows(4)
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "out"
    code, _, err = prepare_cli("--chat", src, "--out", out, "--tokenizer-from", base_data, "--block-size", "64")
    assert (code, err) == (
        2,
        f"error: {src}, row 2: not JSON (Expecting property name enclosed in double quotes at column 2)\n",
    )
    assert not out.exists()
    code, stdout, err = prepare_cli(
        "--chat", src, "--out", out, "--tokenizer-from", base_data, "--block-size", "256", "--skip-bad-rows",
        "--val-fraction", "0.2",
    )  # fmt: skip
    assert code == 0, err
    assert stdout.endswith("4 bad rows skipped\n") and "6 conversations" in stdout
    assert f"skipped {src}, row 4: a row with keys question is none of the chat formats" in err
    ds = open_chat_dataset(out)
    tok = get_tokenizer(dataset_spec(out).spec)
    texts = sorted(tok.decode(ds.conversation(s, i)[0]) for s in ("train", "val") for i in range(ds.conversations(s)))
    assert "<|user|>Translate\n\nKatze<|end|><|assistant|>cat<|end|>" in texts
    assert "<|user|>Hallo<|end|><|assistant|>Hello<|end|>" in texts


def test_sharegpt_rows(base_data, tmp_path):
    good = {"conversations": [{"from": "system", "value": "Kurz."}, {"from": "human", "value": "Hund"},
                              {"from": "gpt", "value": "dog"}]}  # fmt: skip
    src = write_jsonl(tmp_path / "s.jsonl", [good] * 10 + [{"conversations": [{"from": "bot", "value": "x"}]}])
    code, _, err = prepare_cli("--chat", src, "--out", tmp_path / "o", "--tokenizer-from", base_data)
    assert (code, err) == (2, f"error: {src}, row 11: turn 0 is from 'bot'; expected one of system, human, gpt\n")
    out = prepare_chat([src], tmp_path / "ok", tokenizer_from=base_data, skip_bad_rows=True, log=lambda m: None)
    assert out.bad_rows == 1
    tok = get_tokenizer(dataset_spec(tmp_path / "ok").spec)
    ids, mask = open_chat_dataset(tmp_path / "ok").conversation("train", 0)
    assert tok.decode(ids) == "<|system|>Kurz.<|end|><|user|>Hund<|end|><|assistant|>dog<|end|>"
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "dog<|end|>"


def test_developer_is_read_as_the_system_role_in_files_and_sample_input():
    from gpt.data.chat import conversation
    from gpt.infer.chat import conversation_line

    said = [{"role": "developer", "content": "Kurz."}, {"role": "user", "content": "Hund", "name": "ann"}]
    row = {"messages": [*said, {"role": "assistant", "content": "dog"}]}
    assert [m["role"] for m in conversation(row)] == ["system", "user", "assistant"]
    assert conversation_line(json.dumps(said)) == [
        {"role": "system", "content": "Kurz."},
        {"role": "user", "content": "Hund"},
    ]


def test_parquet_chat_files_read_as_their_jsonl(base_data, tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = chat_rows(30)
    jsonl = write_jsonl(tmp_path / "c.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")  # messages: list of structs
    for src in (jsonl, tmp_path / "c.parquet"):
        prepare_chat([src], tmp_path / src.suffix[1:], tokenizer_from=base_data, block_size=256)
    for name in ("train.bin", "train.mask.bin", "train.idx", "val.bin"):
        assert (tmp_path / "jsonl" / name).read_bytes() == (tmp_path / "parquet" / name).read_bytes()
    alpaca = [{"instruction": "Translate", "input": None, "output": "cat"}] * 10  # null: no input
    pq.write_table(pa.Table.from_pylist(alpaca), tmp_path / "a.parquet")
    prepare_chat([tmp_path / "a.parquet"], tmp_path / "a", tokenizer_from=base_data, block_size=256)
    tok = get_tokenizer(dataset_spec(tmp_path / "a").spec)
    ids, _ = open_chat_dataset(tmp_path / "a").conversation("train", 0)
    assert tok.decode(ids) == "<|user|>Translate<|end|><|assistant|>cat<|end|>"
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read .*bad.parquet as Parquet"):
        prepare_chat([tmp_path / "bad.parquet"], tmp_path / "b", tokenizer_from=base_data)


def test_long_conversations_are_truncated_or_skipped_and_counted(base_data, tmp_path):
    rows = chat_rows(40)
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    lengths = [len(r["messages"][0]["content"]) + len(r["messages"][1]["content"]) + 4 for r in rows]
    long = sum(n > 101 for n in lengths)
    assert 0 < long < 40
    val = [write_jsonl(tmp_path / "v.jsonl", [{"prompt": "Hallo", "completion": "Hello"}] * 3)]
    cut = prepare_chat([src], tmp_path / "cut", val_inputs=val, tokenizer_from=base_data, block_size=100)
    assert cut.truncated + cut.skipped_long == long and cut.truncated > 0
    assert max(open_chat_dataset(tmp_path / "cut").lengths("train")) == 101
    skip = prepare_chat([src], tmp_path / "skip", val_inputs=val, tokenizer_from=base_data, block_size=100, long="skip")
    assert (skip.truncated, skip.skipped_long) == (0, long)
    assert f"{long} longer than the block skipped" in skip.line()


def test_prepare_shows_reading_and_rendering_and_an_error_starts_its_own_line(base_data, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", chat_rows(40))
    prepare_chat([src], tmp_path / "ok", tokenizer_from=base_data, block_size=256, progress=True)
    err = capsys.readouterr().err
    assert (
        "read [########################] 100%" in err
        and "render [########################] 100% 40/40 conversations" in err
    )

    bad = write_jsonl(tmp_path / "bad.jsonl", chat_rows(40) + ["{oops"])
    clock = iter(range(1000))  # every update a second later: the bar is drawn before the bad row
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("gpt.progress.time.perf_counter", lambda: float(next(clock)))
        with pytest.raises(DataError, match="row 41: not JSON"):
            prepare_chat([bad], tmp_path / "bad", tokenizer_from=base_data, block_size=256, progress=True)
    err = capsys.readouterr().err
    assert "read [" in err and err.endswith("\r\x1b[K")  # erased, so the error's line starts clean


def test_cli_mistakes_are_one_line(base_data, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", chat_rows(5))
    deep_json = tmp_path / "d.json"
    deep_json.write_text("[" * 100_000 + "]" * 100_000)
    for args, message in [
        (["--chat", src, "--max-len", "3"], "--max-len is for --pairs datasets, not --chat"),
        (["--chat", src, "--tokenizer", "bpe"], "--tokenizer bpe: a chat dataset is encoded with the base model's"),
        (["--chat", tmp_path / "nope.jsonl", "--tokenizer-from", base_data], "chat file not found"),
        (
            ["x.txt", "--chat", src],
            "give one of INPUT files, --pairs SRC TGT, --chat FILE or --preferences FILE, not INPUT and --chat",
        ),
        (["x.txt", "--long", "skip"], "--long is for --chat and --preferences datasets, not INPUT text"),
        (
            ["--chat", write_jsonl(tmp_path / "e.jsonl", []), "--tokenizer-from", base_data],
            "e.jsonl: no conversation (empty)",
        ),
        (
            ["--chat", write_jsonl(tmp_path / "b.jsonl", ["x"]), "--tokenizer-from", base_data, "--skip-bad-rows"],
            "no conversation (all 1 rows were bad)",
        ),
        (["--chat", src, "--vocab-size", "512"], "--vocab-size is for INPUT text and --pairs datasets, not --chat"),
        (["--chat", src, "--val-chat", src, "--val-fraction", "0.2"], "--val-fraction: only without --val-chat"),
        (["--chat", src, "--val-chat", src, "--seed", "3"], "--seed: only without --val-chat"),
        (["--pairs", src, src, "--val-pairs", src, src, "--seed", "3"], "--seed: only without --val-pairs"),
        (
            ["--pairs", src, src, "--max-row-bytes", "9"],
            "--max-row-bytes is for INPUT text, --chat and --preferences datasets",
        ),
        (["--chat", src, "--max-row-bytes", "0"], "--max-row-bytes must be at least 1, got 0"),
        (
            ["--pairs", src, src, "--max-output-bytes", "9"],
            "--max-output-bytes is for INPUT text, --chat and --preferences datasets",
        ),
        (["--chat", src, "--max-output-bytes", "0"], "--max-output-bytes must be at least 1, got 0"),
        (
            ["--chat", deep_json, "--tokenizer-from", base_data],
            "d.json is not JSON this reader takes (nested too deeply)",
        ),
        (
            ["--chat", src, "--tokenizer", "gpt2", "--tokenizer-from", base_data],
            f"--tokenizer gpt2 and --tokenizer-from {base_data} (a 'char' tokenizer): give one or the other",
        ),
        (["x.txt", "--tokenizer-from", base_data, "--vocab-size", "300"], "--vocab-size 300 and --tokenizer-from"),
    ]:
        code, out, err = prepare_cli(*args, "--out", tmp_path / "o")
        assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert len(err) < 400, err  # never a tokenizer spec's dump (a bpe's holds its ranks)


def test_packing_trains_on_each_conversation_once_per_epoch(chat_data):
    ds = open_chat_dataset(chat_data)
    batches = PackedBatches(ds, "train", block_size=512, batch_size=4, seed=3)
    rows = batches.epoch(0)
    assert sorted(i for row in rows for i in row) == list(range(260))
    assert all(sum(ds.lengths("train")[row]) <= 513 for row in rows)
    assert len(rows) < 260 / 2  # packing: several conversations per window
    assert batches.epoch(1) != rows  # a new order each epoch
    x, y, doc = batches.get(5)
    again = PackedBatches(ds, "train", block_size=512, batch_size=4, seed=3).get(5)
    assert all(torch.equal(a, b) for a, b in zip((x, y, doc), again))  # a pure function of (seed, step)
    for r, row in enumerate(batches.rows(20, 4)):
        at = 0
        for n, i in enumerate(row):
            ids, mask = ds.conversation("train", i)
            assert torch.equal(x[r, at : at + len(ids)], torch.from_numpy(ids)) if at + len(ids) <= 512 else True
            want = np.where(mask[1:], ids[1:], -1)
            assert torch.equal(y[r, at : at + len(ids) - 1], torch.from_numpy(want)[: 512 - at])
            assert (doc[r, at : at + len(ids)][: 512 - at] == n).all()
            if at + len(ids) - 1 < 512:
                assert y[r, at + len(ids) - 1] == -1  # no target across two conversations
            at += len(ids)
        assert (y[r, at:] == -1).all()  # nor in the padding
    _, y_all, _ = PackedBatches(ds, "train", block_size=512, batch_size=4, seed=3, loss_on="all").get(5)
    assert (y_all != -1).sum() > (y != -1).sum()


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_packed_conversations_do_not_see_each_other(pos_encoding):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=24, n_layer=2, n_head=2, n_embd=16, pos_encoding=pos_encoding))
    model.eval()
    a, b = torch.randint(0, 50, (1, 9)), torch.randint(0, 50, (1, 11))
    x = torch.cat([a, b, torch.zeros(1, 4, dtype=torch.long)], 1)
    doc = torch.tensor([[0] * 9 + [1] * 11 + [2] * 4])
    packed, _ = model(x, doc=doc)
    alone_b, _ = model(b)
    torch.testing.assert_close(packed[:, 9:20], alone_b)  # as if alone: positions restart, no attention to a
    x2 = x.clone()
    x2[0, :9] = torch.randint(0, 50, (9,))
    changed, _ = model(x2, doc=doc)
    assert torch.equal(changed[:, 9:20], packed[:, 9:20]) and not torch.equal(changed[:, :9], packed[:, :9])


def test_masked_loss_is_the_mean_over_the_assistants_tokens(chat_data):
    torch.manual_seed(0)
    ds = open_chat_dataset(chat_data)
    model = GPT(GPTConfig(vocab_size=ds.vocab_size, block_size=512, n_layer=1, n_head=2, n_embd=16))
    rows = [[0, 1], [2]]
    x, y, doc = batch(ds, "train", rows, 512)
    _, loss = model(x, y, doc=doc)
    total, count = 0.0, 0
    for i in (0, 1, 2):  # each conversation alone, its loss summed by hand over the masked positions
        ids, mask = ds.conversation("train", i)
        logits, _ = model(torch.from_numpy(ids[None, :-1]))
        nll = -F.log_softmax(logits[0], -1)[torch.arange(len(ids) - 1), torch.from_numpy(ids[1:])]
        total += nll[torch.from_numpy(mask[1:])].sum().item()
        count += int(mask[1:].sum())
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_growing_the_vocabulary_keeps_the_old_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(0, 60, (2, 10))
    before, _ = model(x)
    model.grow_vocab(128, range(60, 64))
    after, _ = model(x)
    assert after.shape[-1] == 128 and model.lm_head.weight is model.transformer.wte.weight
    torch.testing.assert_close(after[..., :60], before[..., :60], rtol=0, atol=0)
    fresh = model.transformer.wte.weight[60:64]
    mean = model.transformer.wte.weight[:60].mean(0)
    assert (fresh - mean).abs().max() < 0.2 and not torch.equal(fresh[0], fresh[1])


def test_sft_from_a_base_grows_the_vocab_trains_on_answers_and_resumes_exactly(base_run, chat_data, tmp_path, capsys):
    common = ["--data", chat_data, "--init-from", base_run, "--config", "sft", *TINY, "--eval-interval", "3"]
    common += ["--lr-decay-iters", "6"]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "6")
    assert "special tokens (ids" in capsys.readouterr().out
    train_run(*common, "--out-dir", tmp_path / "half", "--max-iters", "3")
    train_run("--resume", tmp_path / "half", "--max-iters", "6")

    def records(run, kind):
        return [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["kind"] == kind]

    full = [(r["step"], r["loss"]) for r in records(tmp_path / "full", "train")]
    assert [(r["step"], r["loss"]) for r in records(tmp_path / "half", "train")] == full
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    window_tokens = 6 * cfg["train"]["batch_size"] * cfg["train"]["grad_accum"] * cfg["model"]["block_size"]
    for run in ("full", "half"):  # tokens/s and MFU count every position read, not only the answers
        assert records(tmp_path / run, "train")[-1]["tokens"] == window_tokens
    assert records(tmp_path / "half", "eval")[-1]["val_loss"] == records(tmp_path / "full", "eval")[-1]["val_loss"]
    model, meta = loader.load_model(tmp_path / "full")
    assert meta["chat_template"]["end"] == "<|end|>" and meta["tokenizer"]["kind"] == "specials"
    assert model.config.vocab_size >= open_chat_dataset(chat_data).vocab_size
    train_run(*common, "--out-dir", tmp_path / "all", "--max-iters", "3", "--loss-on", "all")
    assert records(tmp_path / "all", "eval")[-1]["val_loss"] != records(tmp_path / "half", "eval")[0]["val_loss"]


def test_a_chat_dataset_refuses_an_encoder_a_short_block_and_another_base(base_run, chat_data, tmp_path):
    from gpt.errors import ConfigError
    from gpt.train.start import TrainingError

    with pytest.raises(ConfigError, match="block_size: the model's 32 is too short for the dataset's longest"):
        train_run(
            "--data", chat_data, "--init-from", base_run, "--out-dir", tmp_path / "b", *TINY, "--block-size", "32"
        )
    again = train_run(
        "--data", chat_data, "--init-from", base_run, "--out-dir", tmp_path / "b", *TINY, "--max-iters", "1"
    )
    assert again["step"] == 1  # the start that failed left the directory free
    with pytest.raises(ConfigError, match="a chat dataset trains a decoder-only model"):
        train_run("--data", chat_data, "--out-dir", tmp_path / "e", *TINY, "--n-encoder-layer", "1", "--max-iters", "1")
    other = tmp_path / "other.txt"
    other.write_text("".join(chr(ord("A") + i % 60) for i in range(20000)))
    other_run = tmp_path / "o"
    data = prepare(other, tmp_path / "od", "--tokenizer", "char", "--block-size", "64")
    train_run("--data", data, "--out-dir", other_run, *TINY, "--block-size", "64", "--max-iters", "1")
    with pytest.raises(TrainingError, match="tokenizer mismatch"):
        train_run("--data", chat_data, "--init-from", other_run, "--out-dir", tmp_path / "x", *TINY, "--max-iters", "1")


def test_lora_sft_trains_the_new_tokens_loads_resumes_and_merges(base_run, chat_data, tmp_path):
    from gpt.cli.lora import merge_checkpoint

    common = ["--data", chat_data, "--init-from", base_run, "--config", "sft", *TINY, "--lora-rank", "4"]
    common += ["--eval-interval", "2", "--lr-decay-iters", "4", "--learning-rate", "1e-2"]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "4")
    train_run(*common, "--out-dir", tmp_path / "half", "--max-iters", "2")
    train_run("--resume", tmp_path / "half", "--max-iters", "4")

    def losses(run):
        return [
            r["loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["kind"] == "train"
        ]

    assert losses(tmp_path / "half") == losses(tmp_path / "full")  # the base grown the same way on resume
    adapted, meta = loader.load_model(tmp_path / "full")
    n = open_chat_dataset(chat_data).vocab_size  # the base's ids, then the template's four
    assert meta["lora"]["grown"]["fresh"] == [n - 4, n] and "wte" in meta["lora"]["targets"]
    merged, merged_meta = loader.load_model(merge_checkpoint(tmp_path / "full", tmp_path / "merged.pt"))
    assert merged_meta["chat_template"] == meta["chat_template"]
    x = torch.tensor([[n - 4, 10, 11, n - 2, 12]])  # the template's tokens among the base's
    torch.testing.assert_close(merged(x)[0], adapted(x)[0])
    base, _ = loader.load_model(base_run)
    grown = GPT(GPTConfig.from_dict(base.config.to_dict()))
    grown.load_state_dict(base.state_dict())
    grown.grow_vocab(merged.config.vocab_size, range(n - 4, n))
    rows = slice(n - 4, n)
    assert not torch.equal(merged.transformer.wte.weight[rows], grown.transformer.wte.weight[rows])  # they learned


def test_bad_chat_rows_of_every_kind_name_file_and_row_or_are_skipped(base_data, tmp_path):
    good = chat_rows(40)
    unknown = {"prompt": "Translate: Grüße ✓", "completion": "greetings"}  # '✓' is not in the char vocabulary
    deep = "[" * 100_000 + "]" * 100_000
    src = write_jsonl(tmp_path / "c.jsonl", [*good[:10], unknown, deep, *good[10:]])
    code, _, err = prepare_cli("--chat", src, "--tokenizer-from", base_data, "--out", tmp_path / "o")
    assert (code, err) == (2, f"error: {src}, row 11: message 0 holds '✓', not in the char vocabulary\n")
    code, out, err = prepare_cli(
        "--chat", src, "--tokenizer-from", base_data, "--out", tmp_path / "o", "--skip-bad-rows"
    )
    assert code == 0 and "40 conversations" in out and "2 bad rows skipped" in out, err
    assert f"skipped {src}, row 12: not JSON this reader takes (nested too deeply)" in err
    val = write_jsonl(tmp_path / "v.jsonl", ["x", "y"])  # every val row bad: its count is its own, not train's too
    args = ("--chat", src, "--val-chat", val, "--tokenizer-from", base_data, "--out", tmp_path / "p", "--skip-bad-rows")
    code, _, err = prepare_cli(*args)
    assert code == 2 and err.endswith(f"error: --val-chat {val}: no conversation (all 2 rows were bad)\n"), err


def test_a_gzip_chat_file_of_one_conversation_repeated_stops_at_max_output_bytes(tmp_path):
    """A few KB of gzip holding 2,000 copies of one conversation: the chat dataset stops at its limit too, and
    a chat dataset already there stays as it was."""
    out = tmp_path / "o"
    code, _, err = prepare_cli("--chat", write_jsonl(tmp_path / "c.jsonl", chat_rows(40)), "--tokenizer", "gpt2",
                               "--block-size", "128", "--out", out)  # fmt: skip
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    row = {"messages": [{"role": "user", "content": "a!" * 10}, {"role": "assistant", "content": "a!" * 100}]}
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress((json.dumps(row) + "\n").encode() * 2000, compresslevel=9))
    assert bomb.stat().st_size < 10_000
    args = ("--chat", bomb, "--tokenizer", "gpt2", "--block-size", "128", "--out", out, "--force")
    code, _, err = prepare_cli(*args, "--max-output-bytes", 100_000)
    assert (code, err) == (
        2,
        f"error: the dataset would take more than --max-output-bytes 100,000 bytes; raise it if the corpus is that "
        f"large; {out} was left as it was\n",
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    code, out_line, err = prepare_cli(*args)  # the default: 32 times its bytes, at least 16 MiB
    assert code == 0 and "2,000 conversations" in out_line, err


def test_a_chat_row_with_a_whitespace_run_tiktoken_cannot_take_whole_prepares(tmp_path):
    rows = [*chat_rows(30), {"prompt": "spaces", "completion": "ok" + " " * 1_100_000 + "end"}]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    for extra in ([], ["--skip-bad-rows"]):
        code, out, err = prepare_cli("--chat", src, "--tokenizer", "gpt2", "--out", tmp_path / "o", "--force", *extra)
        assert code == 0 and "31 conversations" in out and "1 longer than the block truncated" in out, err
