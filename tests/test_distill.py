"""Knowledge distillation (gpt/train/distill.py): the KL term by hand, alpha 0 as the plain run, a frozen
teacher, masked targets, one-line refusals, exact resume and a LoRA student."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import CHAT_TRAIN, TRAIN, one_line_error, save_random_lm, torchrun, train_run, train_script

from gpt.checkpoints import native
from gpt.checkpoints.hf import export_hf
from gpt.checkpoints.loader import load_checkpoint
from gpt.data.tokens import open_dataset
from gpt.model.transformer import GPT, GPTConfig
from gpt.runtime import Runtime
from gpt.train.distill import Teacher, kl_term
from gpt.train.step import train_step
from gpt.train.tasks import open_task

pytestmark = pytest.mark.usefixtures("one_thread")

STUDENT = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16"]


def Cfg(path, alpha=0.5, temperature=2.0):
    """The settings `Teacher.load` reads of a TrainConfig."""
    return SimpleNamespace(distill_from=str(path), data="data", distill_alpha=alpha, distill_temperature=temperature)


def losses(out):
    rows = map(json.loads, (out / "log.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


def evals(out):
    rows = map(json.loads, (out / "log.jsonl").read_text().splitlines())
    return [(r["step"], r["val_loss"]) for r in rows if r["kind"] == "eval"]


@pytest.fixture
def teacher(tiny_char_data, tmp_path):
    """A run directory holding a random 2-layer model with the tiny dataset's tokenizer, its vocabulary padded
    to 128 rows (the students': 64)."""
    torch.manual_seed(7)
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    meta = native.build_meta(model_config=cfg.to_dict(), tokenizer=open_dataset(tiny_char_data).tokenizer_spec)
    native.save(tmp_path / "teacher" / "best.pt", {"model": GPT(cfg).state_dict()}, meta)
    return tmp_path / "teacher"


def test_kl_term_is_kl_div_over_the_real_vocabulary_and_unmasked_positions_times_t_squared():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 12) * 3, torch.randn(2, 3, 16) * 3  # 10 real ids, padded differently
    targets = torch.tensor([[1, -1, 4], [-1, 2, 3]])
    for t in (1.0, 2.0, 0.5):
        keep = targets != -1
        by_hand = F.kl_div(
            F.log_softmax(student[keep][:, :10] / t, -1),
            F.log_softmax(teacher[keep][:, :10] / t, -1),
            log_target=True,
            reduction="batchmean",  # the sum over the vocabulary, the mean over the 4 kept positions
        )
        assert kl_term(student, teacher, targets, 10, t).item() == pytest.approx(t * t * by_hand.item(), rel=1e-5)
    base = kl_term(student, teacher, targets, 10, 2.0)
    moved = student.clone()
    moved[0, 1] += torch.randn(12) * 5  # a masked position
    moved[..., 10:] = 100.0  # the padding rows
    assert torch.equal(kl_term(moved, teacher, targets, 10, 2.0), base)
    assert kl_term(teacher[..., :12], teacher, targets, 10, 2.0).abs().item() < 1e-6  # KL(p || p) = 0


def test_alpha_zero_is_the_plain_run_exactly(teacher, tiny_char_data, tmp_path):
    common = ["--data", tiny_char_data, *STUDENT, *TRAIN, "--max-iters", "3", "--eval-interval", "3"]
    train_run(*common, "--out-dir", tmp_path / "plain")
    train_run(*common, "--out-dir", tmp_path / "a0", "--distill-from", teacher, "--distill-alpha", "0")
    train_run(*common, "--out-dir", tmp_path / "a5", "--distill-from", teacher, "--distill-alpha", "0.5")
    assert losses(tmp_path / "a0") == losses(tmp_path / "plain")  # bit for bit
    assert evals(tmp_path / "a0") == evals(tmp_path / "plain")
    assert losses(tmp_path / "a5")[0][1] != losses(tmp_path / "plain")[0][1]  # the KL term is there


def test_the_teacher_gets_no_gradients_and_stays_unchanged(teacher, tiny_char_data):
    rt = Runtime(torch.device("cpu"), torch.float32)
    task = open_task(str(tiny_char_data))
    t = Teacher.load(Cfg(teacher), task, rt, student_vocab=64)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    student = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x, y = torch.randint(0, task.vocab_size, (4, 16)), torch.randint(0, task.vocab_size, (4, 16))
    opt = torch.optim.SGD(student.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, _, _ = train_step(student, opt, scaler, lambda s, m: (x, y), 0, 2, rt, 0.0, teacher=t)
    opt.step()
    assert not t.model.training and all(p.grad is None and not p.requires_grad for p in t.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    with torch.no_grad():
        logits, plain = student.eval()(x, y)  # (no dropout either way)
    assert loss.item() != pytest.approx(plain.item())  # the step's loss was the mixed one


def test_a_teacher_with_another_tokenizer_or_pp_is_one_line(tiny_char_data, tmp_path, capsys):
    other = save_random_lm(tmp_path / "other", "abc")
    common = ["--data", tiny_char_data, "--out-dir", tmp_path / "run", *STUDENT, *TRAIN, "--max-iters", "1"]
    err = one_line_error(capsys, train_script.main, *common, "--distill-from", other)
    assert f"--distill-from {other}" in err and "tokenizer" in err and str(tiny_char_data) in err
    err = one_line_error(capsys, train_script.main, *common, "--distill-from", other, "--pp", "2")
    assert "--distill-from: not with --pp" in err
    err = one_line_error(capsys, train_script.main, *common, "--distill-from", tmp_path / "nothing")
    assert err.startswith(f"error: --distill-from: no checkpoint at {tmp_path / 'nothing'}")
    err = one_line_error(capsys, train_script.main, *common, "--distill-alpha", "0.3")
    assert "--distill-alpha: give --distill-from" in err


def test_a_distillation_run_resumes_exactly(teacher, tiny_char_data, tmp_path):
    common = [
        "--data",
        tiny_char_data,
        *STUDENT,
        *TRAIN,
        "--distill-from",
        teacher,
        "--distill-temperature",
        "1.5",
        "--dropout",
        "0.1",
        "--grad-accum",
        "2",
        "--lr-decay-iters",
        "6",
        "--eval-interval",
        "3",
    ]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "6")
    train_run(*common, "--out-dir", tmp_path / "split", "--max-iters", "3")
    train_run("--resume", tmp_path / "split", "--max-iters", "6")
    assert [s for s, *_ in losses(tmp_path / "split")] == list(range(1, 7))
    assert losses(tmp_path / "split") == losses(tmp_path / "full")  # bit for bit


def test_a_lora_student_distils(base, teacher, tiny_char_data, tmp_path):
    common = ["--data", tiny_char_data, "--init-from", base, "--lora-rank", "4", *TRAIN, "--max-iters", "2"]
    train_run(*common, "--out-dir", tmp_path / "plain", "--eval-interval", "2")
    train_run(*common, "--out-dir", tmp_path / "lora", "--eval-interval", "2", "--distill-from", teacher)
    saved = native.read_file(tmp_path / "lora" / "last.pt")
    assert "lora" in saved["meta"] and all("lora" in k for k in saved["model"])  # only the adapters
    assert saved["meta"]["train_config"]["distill_from"] == str(teacher)
    assert losses(tmp_path / "lora")[0][1] != losses(tmp_path / "plain")[0][1]


def test_a_hugging_face_teacher_gives_the_same_logits_as_its_checkpoint(teacher, tiny_char_data, tmp_path):
    model, tok, _ = load_checkpoint(teacher)
    export_hf(model, tok, tmp_path / "hf")
    rt = Runtime(torch.device("cpu"), torch.float32)
    task = open_task(str(tiny_char_data))
    x = torch.randint(0, task.vocab_size, (2, 16))
    logits = [
        Teacher.load(Cfg(path), task, rt, student_vocab=64).logits((x, None)) for path in (teacher, tmp_path / "hf")
    ]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_fsdp_distils_from_a_sharded_teacher_as_one_process_does(tiny_char_data, tmp_path):
    """A DCP teacher (an --fsdp run's last.dcp), its logits computed on each process for its own micro-batches:
    the losses equal one process's to rel 1e-5 (float32; gradients summed in another order)."""
    common = ["--data", tiny_char_data, *TRAIN, "--grad-accum", "2", "--grad-clip", "0", "--eval-interval", "2"]
    big = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
    torchrun(2, *common, *big, "--max-iters", "2", "--out-dir", tmp_path / "teacher", "--fsdp")
    assert (tmp_path / "teacher" / "last.dcp").is_dir() and not (tmp_path / "teacher" / "last.pt").exists()
    student = [*common, *STUDENT, "--max-iters", "2", "--distill-from", tmp_path / "teacher"]
    torchrun(2, *student, "--out-dir", tmp_path / "fsdp", "--fsdp")
    train_run(*student, "--out-dir", tmp_path / "one")
    assert [s for s, *_ in losses(tmp_path / "fsdp")] == [1, 2]
    for a, b in zip(losses(tmp_path / "fsdp"), losses(tmp_path / "one")):
        assert a == pytest.approx(b, rel=1e-5)


def test_chat_sft_distils_from_a_chat_teacher_and_refuses_its_base(chat_run, base_run, chat_data, tmp_path, capsys):
    """The chat dataset's prompts (targets -1) are masked in the KL as in the usual loss (kl_term above); its
    base, without the template's tokens, is another tokenizer."""
    common = [
        "--data",
        chat_data,
        "--config",
        "sft",
        *CHAT_TRAIN,
        "--block-size",
        "192",
        "--max-iters",
        "1",
        "--eval-interval",
        "1",
    ]
    train_run(*common, "--out-dir", tmp_path / "chat", "--distill-from", chat_run)
    assert len(losses(tmp_path / "chat")) == 1
    err = one_line_error(capsys, train_script.main, *common, "--out-dir", tmp_path / "b", "--distill-from", base_run)
    assert "tokenizer" in err and str(base_run) in err
