"""TRL's assistant-only loss on our Hugging Face export of a chat model reproduces our loss mask (issue 32): the
exported template's `{% generation %}` marks exactly the tokens gpt.data.chat trains on. TRL's own code path
runs: SFTTrainer's dataset preparation with `assistant_only_loss=True` (the labels it builds, -100 off the
mask) and its collator (the batch the model sees)."""

import pytest
from test_hf_export import CONVERSATIONS, random_model

from gpt.checkpoints.hf import export_hf
from gpt.data.chat import ChatTemplate
from gpt.data.tokenizer import get_tokenizer

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl, the dev extra)")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_trl_assistant_only_loss_reproduces_our_loss_mask(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local: the export and the in-memory dataset
    template = ChatTemplate()
    tok = template.tokenizer(get_tokenizer("gpt2"))  # byte-level: every character of the conversations
    out = export_hf(random_model(tok.vocab_size, "rope", block=128), tok, tmp_path / "hf", template.spec)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss=True,
        max_length=None,  # no truncation: whole conversations
        per_device_train_batch_size=len(CONVERSATIONS),
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(out),
        args=config,
        train_dataset=datasets.Dataset.from_list([{"messages": m} for m in CONVERSATIONS]),
        processing_class=transformers.AutoTokenizer.from_pretrained(out),
    )
    expected = []
    for example, messages in zip(trainer.train_dataset, CONVERSATIONS):
        ids, mask = template.render(messages, tok)
        labels = [i if m else -100 for i, m in zip(ids, mask)]
        assert example["input_ids"] == ids and example["labels"] == labels, messages
        assert 0 < sum(mask) < len(mask)  # the prompt's tokens are off the loss, each answer's end on it
        expected.append(labels)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(CONVERSATIONS))])
    for row, labels in zip(batch["labels"].tolist(), expected):
        assert row == labels + [-100] * (len(row) - len(labels))  # padding is off the loss too
