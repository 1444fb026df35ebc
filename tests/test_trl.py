"""TRL's assistant-only loss on our Hugging Face export of a chat model reproduces our loss mask (issue 32): the
exported template's `{% generation %}` marks exactly the tokens gpt.data.chat trains on. TRL's own code path
runs: SFTTrainer's dataset preparation with `assistant_only_loss=True` (the labels it builds, -100 off the
mask) and its collator (the batch the model sees). Without the markers TRL refuses the template, so a template
that lost them fails here too."""

import pytest
from test_hf_export import CONVERSATIONS, random_model

from gpt import load_checkpoint
from gpt.checkpoints.hf import export_hf
from gpt.cli.hf import main as hf_main
from gpt.data.chat import ChatTemplate
from gpt.data.tokenizer import get_tokenizer
from gpt.infer.chat import chat_template

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl, the dev extra)")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("one_thread")


def trl_prepared(out, conversations, tmp_path):
    """SFTTrainer on the export at `out` with assistant_only_loss: its prepared dataset and collated batch."""
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss=True,
        max_length=None,  # no truncation: whole conversations
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(out),
        args=config,
        train_dataset=datasets.Dataset.from_list([{"messages": m} for m in conversations]),
        processing_class=transformers.AutoTokenizer.from_pretrained(out),
    )
    rows = [trainer.train_dataset[i] for i in range(len(conversations))]
    return rows, trainer.data_collator(rows)


def check_against_ours(rows, batch, conversations, template, tok):
    for example, row, messages in zip(rows, batch["labels"].tolist(), conversations):
        ids, mask = template.render(messages, tok)
        labels = [i if m else -100 for i, m in zip(ids, mask)]
        assert 0 < sum(mask) < len(mask)  # the prompt's tokens are off the loss, each answer's end on it
        assert example["input_ids"] == ids and example["labels"] == labels, messages
        assert row == labels + [-100] * (len(row) - len(labels))  # padding is off the loss too


def test_trl_assistant_only_loss_reproduces_our_loss_mask(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local: the export and the in-memory dataset
    template = ChatTemplate()
    tok = template.tokenizer(get_tokenizer("gpt2"))  # byte-level: every character of the conversations
    out = export_hf(random_model(tok.vocab_size, "rope", block=128), tok, tmp_path / "hf", template.spec)
    rows, batch = trl_prepared(out, CONVERSATIONS, tmp_path)
    check_against_ours(rows, batch, CONVERSATIONS, template, tok)


def test_trl_on_a_trained_chat_checkpoints_export(chat_run, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_main(["export", "--ckpt", str(chat_run), "--out", str(tmp_path / "hf")]) == 0
    _, tok, meta = load_checkpoint(chat_run)
    template = chat_template(meta)
    keep = lambda text: "".join(c for c in text if c in tok.base.stoi)  # noqa: E731  (a char vocabulary)
    conversations = [[{**m, "content": keep(m["content"])} for m in c] for c in CONVERSATIONS]
    rows, batch = trl_prepared(tmp_path / "hf", conversations, tmp_path)
    check_against_ours(rows, batch, conversations, template, tok)
