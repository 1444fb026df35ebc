"""Our DPO and ORPO losses and gradients equal TRL's on one batch (issue 48): a tiny model of ours and a
reference exported to Hugging Face, TRL's own trainers on the exports (DPOTrainer's `compute_loss`, whose
collator builds the batch; ORPOTrainer's `get_batch_loss_metrics`), against `Preference.loss` on the batch our
preference dataset gives for the same pairs. Loss, the figures TRL logs, and every parameter's gradient
(TRL's mapped back to our names and layouts) agree within float32 tolerance."""

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from conftest import write_jsonl
from test_hf_export import random_model

from gpt.checkpoints.hf import export_hf, state_dict_from_hf
from gpt.data.preference_batches import batch, open_preferences
from gpt.data.preferences import prepare_preferences
from gpt.data.tokenizer import CharTokenizer
from gpt.data.vocab import Reused
from gpt.train.prefer import Preference

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl, the dev extra)")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("one_thread")

CHARS = "abcdefghij .?!"
PAIRS = [  # prompts and answers of different lengths: padding on both sides of the batch
    ("abc def", "ghi", "j"),
    ("hi", "a b c d e", "ab"),
    ("hide a bag?", "a cab.", "dead!"),
    ("j", "fig", "bag bed"),
]
RT = SimpleNamespace(autocast=nullcontext, ddp=False, dtype=torch.float32, device=torch.device("cpu"))
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(our policy, our reference, their paths as HF exports, the preference dataset of PAIRS)."""
    d = tmp_path_factory.mktemp("prefer_trl")
    tok = CharTokenizer(CHARS)
    policy, reference = random_model(tok.vocab_size, seed=0), random_model(tok.vocab_size, seed=1)
    for m in (policy, reference):
        with torch.no_grad():  # smaller logits than random_model's: log-probs of a usual size
            for p in m.parameters():
                p.mul_(0.5)
    hf_policy, hf_reference = export_hf(policy, tok, d / "policy"), export_hf(reference, tok, d / "reference")
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    write_jsonl(d / "pairs.jsonl", rows)
    write_jsonl(d / "val.jsonl", rows[:1])
    prepare_preferences(
        [d / "pairs.jsonl"], d / "data", val_inputs=[d / "val.jsonl"], tokenizer_from=Reused(tok.spec, "char")
    )
    return policy, reference, hf_policy, hf_reference, open_preferences(d / "data"), d


def examples(ds):
    """The dataset's pairs as TRL's tokenized rows: prompt_ids, chosen_ids, rejected_ids."""
    out = []
    for i in range(ds.pairs("train")):
        (c, cm), (r, rm) = ds.sequence("train", 2 * i), ds.sequence("train", 2 * i + 1)
        assert (c[~cm] == r[~rm]).all()  # one prompt
        out.append({"prompt_ids": c[~cm].tolist(), "chosen_ids": c[cm].tolist(), "rejected_ids": r[rm].tolist()})
    return out


def ours(model, reference, ds, kind, **options):
    """Our loss, figures and gradients (by our parameter names) on the dataset's pairs, in order."""
    model.train()
    model.zero_grad()
    objective = Preference(kind, RT, options.get("beta", 0.1), options.get("dpo_loss", "sigmoid"),
                           options.get("orpo_lambda", 0.1), reference)  # fmt: skip
    loss = objective.loss(model, batch(ds, "train", list(range(ds.pairs("train")))))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss.item(), objective.take_metrics(), grads


def hf_grads(model):
    """The HF model's gradients under our names and layouts. Our head is the embedding (tied); where the trainer
    holds the head as a parameter of its own (equal to the embedding), the tied gradient is the sum of both."""
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    head = grads.pop("lm_head.weight", None)
    if head is not None:
        assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
        grads["transformer.wte.weight"] = grads["transformer.wte.weight"] + head
    mapped = state_dict_from_hf(grads)
    mapped.pop("lm_head.weight")  # (the mapping's alias of the embedding, for loading a state dict)
    return mapped


def trl_args(tmp, cls, **kw):
    return cls(output_dir=str(tmp / "trl"), report_to="none", use_cpu=True, bf16=False, max_length=None, **kw)


def trl_dpo(hf_policy, hf_reference, ds, tmp, beta, loss_type):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_policy)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_reference)
    args = trl_args(tmp, trl.DPOConfig, beta=beta, loss_type=[loss_type], precompute_ref_log_probs=False)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]),
        processing_class=transformers.AutoTokenizer.from_pretrained(hf_policy),
    )
    inputs = trainer.data_collator(examples(ds))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    figures = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), figures, hf_grads(trainer.model)


def trl_orpo(hf_policy, ds, tmp, lam):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_policy)
    trainer = ORPOTrainer(
        model=model,
        args=trl_args(tmp, ORPOConfig, beta=lam),
        train_dataset=datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]),
        processing_class=transformers.AutoTokenizer.from_pretrained(hf_policy),
    )
    rows = examples(ds)
    width = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows)
    inputs = {}
    for side in ("chosen", "rejected"):  # the batch ORPOTrainer's tokenize_row and collator make: prompt + answer,
        ids, mask, labels = [], [], []  # labels -100 on the prompt and the padding
        for r in rows:
            seq = r["prompt_ids"] + r[f"{side}_ids"]
            pad = width - len(seq)
            ids.append(seq + [0] * pad)
            mask.append([1] * len(seq) + [0] * pad)
            labels.append([-100] * len(r["prompt_ids"]) + r[f"{side}_ids"] + [-100] * pad)
        inputs |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    inputs = {k: torch.tensor(v) for k, v in inputs.items()}
    trainer.model.train()
    loss, figures = trainer.get_batch_loss_metrics(trainer.model, inputs)
    loss.backward()
    return loss.item(), figures, hf_grads(trainer.model)


def check(mine, theirs, names):
    (loss, figures, grads), (their_loss, their_figures, their_grads) = mine, theirs
    assert loss == pytest.approx(their_loss, rel=1e-5), (loss, their_loss)
    for name in names:
        assert figures[name] == pytest.approx(their_figures[name], rel=1e-4, abs=1e-6), name
    assert set(grads) == set(their_grads)
    for k in grads:
        torch.testing.assert_close(grads[k], their_grads[k], **TOL, msg=k)


FIGURES = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.3), ("hinge", 0.2)])
def test_dpo_loss_and_gradients_equal_trls(setup, monkeypatch, loss_type, beta):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    policy, reference, hf_policy, hf_reference, ds, tmp = setup
    mine = ours(policy, reference.eval(), ds, "dpo", beta=beta, dpo_loss=loss_type)
    assert abs(mine[1]["rewards/margins"]) > 1e-3  # the models differ: a test that can tell betas apart
    check(mine, trl_dpo(hf_policy, hf_reference, ds, tmp, beta, loss_type), FIGURES + ["logps/rejected"])


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_loss_and_gradients_equal_trls(setup, monkeypatch, lam):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    policy, _, hf_policy, _, ds, tmp = setup
    mine = ours(policy, None, ds, "orpo", orpo_lambda=lam)
    theirs = trl_orpo(hf_policy, ds, tmp, lam)
    check(mine, theirs, FIGURES + ["logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"])
    assert json.dumps(sorted(mine[1])) == json.dumps(sorted(k for k in mine[1] if k in theirs[1]))
