"""GRPO (issue 48 section 3): the loss against TRL's GRPOTrainer computation on fixed batches, by hand and by
finite differences; group advantages; the sampler against an uncached forward; the rewards; `gpt train
--objective grpo` end to end on a tiny model, exact resume, its 2-process run against one process, prompts through a
chat template; the one-line refusals. The worked example that shows it learning is bench/bench_grpo.py."""

import json
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import one_line_error, torchrun, train_run, train_script, write_jsonl
from test_prefer import random_lm

from gpt.errors import ConfigError
from gpt.model.transformer import GPT, GPTConfig
from gpt.train.grpo import group_advantages, grpo_loss, sample_group, token_logps
from gpt.train.rewards import load_reward

pytestmark = pytest.mark.usefixtures("one_thread")

DIGITS = "0123456789+="
BASIC = [
    "--batch-size",
    "2",
    "--eval-iters",
    "4",
    "--log-interval",
    "1",
    "--warmup-iters",
    "0",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--no-plot",
]
BASIC += ["--learning-rate", "1e-2", "--min-lr", "0", "--grad-clip", "0"]
TINY = [*BASIC, "--group-size", "4", "--grpo-max-new-tokens", "3"]


def problems(n):
    return [{"prompt": f"{i % 7}+{i % 5}=", "answer": str(i % 7 + i % 5)} for i in range(n)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return random_lm(tmp_path_factory.mktemp("grpo_base") / "base", DIGITS, block=16)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_prompts") / "p.jsonl"
    write_jsonl(path, problems(40))
    return path


def log(out, kind="train"):
    return [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r["kind"] == kind]


# ---- the loss --------------------------------------------------------------------------------------------


def fixed_batch(seed=0, n=4, t=5):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    old = logps + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 1.2  # ratios in ~[0.55, 1.8]
    ref = logps + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    return logps, old, ref, adv, mask


def trl_loss(kind, logps, old, ref, adv, mask, epsilon, beta, max_new):
    """TRL's GRPOTrainer._compute_loss on the batch: the trainer built bare, its log-probs given (no model, no
    generation); the attributes it reads set to the defaults of a one-process run."""
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    acc = SimpleNamespace(
        reduce=lambda x, reduction: x, gather=lambda x: x, gather_for_metrics=lambda x: x, num_processes=1
    )
    acc.sync_gradients = True
    t.__dict__.update(
        loss_type=kind,
        beta=beta,
        epsilon_low=epsilon,
        epsilon_high=epsilon,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False),
        model=SimpleNamespace(training=False),  # eval mode: no division by gradient accumulation
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=acc,
        current_gradient_accumulation_steps=1,
        max_completion_length=max_new,
    )
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    n, w = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, w, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return t._compute_loss(None, inputs), t._metrics["eval"]


@pytest.mark.parametrize("kind", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trls(kind, beta):
    """Our loss, its gradient in the policy's log-probs, kl and clip_ratio/region_mean equal TRL's on one batch
    (float64: to 1e-12), ratios on both sides of the clip range."""
    pytest.importorskip("trl")
    logps, old, ref, adv, mask = fixed_batch()
    ours_in = logps.clone().requires_grad_()
    loss, figures = grpo_loss(ours_in, old, ref, adv, mask, 0.2, beta, kind, max_new=5)
    loss.backward()
    theirs_in = logps.clone().requires_grad_()
    theirs, metrics = trl_loss(kind, theirs_in, old, ref, adv, mask, 0.2, beta, 5)
    theirs.backward()
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-15)
    assert 0 < float(figures["clip_ratio/region_mean"]) < 1  # the batch does clip some tokens
    assert float(figures["clip_ratio/region_mean"]) == pytest.approx(metrics["clip_ratio/region_mean"][0])
    if beta:
        assert float(figures["kl"]) == pytest.approx(metrics["kl"][0], rel=1e-12)


def test_loss_by_hand_and_finite_differences():
    """One completion of two tokens, ratio 1 (the first update): the loss is -A (the mean of ratio x A over its
    tokens) and the gradient -A / 2 per token (REINFORCE with the group baseline); with a ratio past 1 + eps and
    A > 0 the token is clipped: no gradient. Every kind's gradient matches central finite differences."""
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor([0.5], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, _ = grpo_loss(logps, logps.detach(), None, adv, mask, 0.2, 0.0)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    assert logps.grad.tolist() == [[-0.25, -0.25]]
    old = torch.tensor([[-1.0, -2.5]], dtype=torch.float64)  # token 2's ratio e^0.5 > 1.2: clipped
    logps.grad = None
    loss, figures = grpo_loss(logps, old, None, adv, mask, 0.2, 0.0)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 + 1.2 * 0.5) / 2)
    assert logps.grad.tolist() == [[-0.25, 0.0]] and float(figures["clip_ratio/region_mean"]) == 0.5
    x, old, ref, adv, mask = fixed_batch(seed=1)
    for kind in ("grpo", "bnpo", "dr_grpo"):
        x = x.clone().requires_grad_()
        torch.autograd.gradcheck(lambda v, k=kind: grpo_loss(v, old, ref, adv, mask, 0.2, 0.1, k, 5)[0], (x,))


def test_advantages_are_normalised_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 4.0, 6.0])
    a = group_advantages(r, 4).view(3, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as TRL's
    torch.testing.assert_close(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert a[1].tolist() == [0.0] * 4  # all alike: no signal
    torch.testing.assert_close(a[2], (r[8:] - 3) / (r[8:].std() + 1e-4))
    torch.testing.assert_close(a.mean(1), torch.zeros(3), atol=1e-6, rtol=0)


# ---- sampling ----------------------------------------------------------------------------------------------


def test_group_sampling_on_the_caches_is_the_uncached_model():
    """Greedy completions on the KV caches are the argmax of a full forward each step; sampled rows stop at
    their stop token (-1 after it), and the log-probs the loss reads are those of the sampled tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    prompt = [12, 1, 10, 2, 11]
    out, n = sample_group(model, prompt, 2, 6, 0.0, [12])
    seq = list(prompt)
    for _ in range(int(n[0])):
        seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
        if seq[-1] == 12:
            break
    assert out[0, : int(n[0])].tolist() == seq[len(prompt) :] and out[0].tolist() == out[1].tolist()
    gen = torch.Generator().manual_seed(3)
    out, n = sample_group(model, prompt, 8, 6, 1.5, [12, 0], gen)
    for row, k in zip(out.tolist(), n.tolist()):
        assert all(t == -1 for t in row[k:])
        assert k == 6 or row[k - 1] in (12, 0)
    assert len(set(map(tuple, out.tolist()))) > 1  # sampled, not greedy
    out, _ = sample_group(model, prompt, 1, 2, 1.0, [], gen)  # no stop token: two tokens
    x = torch.tensor([prompt + out[0, :1].tolist()])
    y = torch.tensor([[-1] * 4 + out[0].tolist()])
    lp = token_logps(model(x)[0], y).detach()
    want = torch.log_softmax(model(x)[0][0, 4], -1)[out[0, 0]].detach()
    assert float(lp[0, 4]) == pytest.approx(float(want), rel=1e-5) and lp[0, :4].tolist() == [0.0] * 4


# ---- rewards ----------------------------------------------------------------------------------------------


def test_rewards(tmp_path, monkeypatch):
    exact = load_reward("exact")
    assert exact(" 19\n", {"answer": "19"}) == 1.0 and exact("19.0", {"answer": 19}) == 0.0
    assert exact("b", {"answer": ["a", "b"]}) == 1.0
    assert "needs 'answer'" in exact.check({"prompt": "x"}) and exact.check({"answer": 3}) is None
    js = load_reward("json")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert js('{"n": 3}', {"schema": schema}) == 1.0 and js('{"n": "3"}', {"schema": schema}) == 0.0
    assert js("[1, 2]", {}) == 1.0 and js("{oops", {}) == 0.0
    with pytest.raises(ConfigError, match="not a JSON Schema"):
        js("{}", {"schema": {"type": 5}})
    bleu = load_reward("bleu")
    ref = {"reference": "a man rides a horse on the beach"}
    assert bleu("a man rides a horse on the beach", ref) == pytest.approx(1.0)
    assert 0 < bleu("a man rides a horse", ref) < 1 and bleu("xyz", ref) == 0.0
    (tmp_path / "my_rewards.py").write_text(
        "def length(text, row):\n    return len(text)\n\ndef bad(text, row):\n    return 'x'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_reward("my_rewards:length")("abc", {}) == 3.0
    with pytest.raises(ConfigError, match="returned 'x', not a finite number"):
        load_reward("my_rewards:bad")("abc", {})
    for spec, message in [
        ("nosuch", "not one of exact, json, bleu, nor a Python callable as module:function"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("my_rewards:missing", "module 'my_rewards' has no 'missing'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_reward(spec)


# ---- gpt train --objective grpo ---------------------------------------------------------------------------


@pytest.fixture
def low_digit(tmp_path, monkeypatch):
    """A module:function reward a random model collects by chance: the completion starts with a digit under 5."""
    (tmp_path / "low_digit.py").write_text("def reward(text, row):\n    return float(text[:1] in '01234')\n")
    monkeypatch.chdir(tmp_path)
    return "low_digit:reward"


def test_a_tiny_run_logs_trls_figures(base, prompts, low_digit, tmp_path):
    """A few steps of a random model, two updates per sampled batch: the log carries TRL's names; the KL is 0
    at step 1 (the policy is the reference) and not at step 2, which trains on step 1's completions; the val
    reward is the greedy completions' and the val loss minus it."""
    out = tmp_path / "run"
    summary = train_run(
        "--objective", "grpo", "--init-from", base, "--data", prompts, "--reward", low_digit, "--out-dir", out,
        *TINY, "--max-iters", "3", "--eval-interval", "3", "--beta", "0.1", "--grpo-updates", "2",
    )  # fmt: skip
    rows = log(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for k in ("reward", "reward_std", "completions/mean_length", "kl", "clip_ratio/region_mean"):
            assert k in r, k
        assert 1 <= r["completions/mean_length"] <= 3 and r["loss"] == r["loss"]
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-6) and rows[0]["clip_ratio/region_mean"] == 0
    assert rows[1]["kl"] > 1e-6
    val = log(out, "eval")[-1]["val_reward"]
    assert 0 <= val <= 1 and summary["val_loss"] == pytest.approx(-val)


def test_reward_rises_on_a_task_the_model_can_learn(base, prompts, low_digit, tmp_path):
    """The chance reward rises over 40 steps of GRPO at a high learning rate: the loss's sign and scale work."""
    out = tmp_path / "run"
    flags = ["--reward", low_digit, "--beta", "0", "--learning-rate", "3e-2", "--group-size", "8"]
    argv = ["--objective", "grpo", "--init-from", base, "--data", prompts, "--out-dir", out, *TINY, *flags]
    train_run(*argv, "--max-iters", "40", "--eval-interval", "40", "--batch-size", "4")
    rewards = [r["reward"] for r in log(out)]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert 0.1 < first < 0.8 and last > first + 0.15, rewards


def test_two_processes_equal_one_accumulating(base, prompts, tmp_path):
    """torchrun with 2 gloo processes, each sampling its own prompts, equals one process accumulating 2
    micro-batches (the same prompts and completions: they are drawn by their place in the global batch): the
    same losses and rewards, to float32 tolerance."""
    common = ["--objective", "grpo", "--init-from", base, "--data", prompts, "--reward", "exact", *TINY]
    common += ["--grad-accum", "2", "--max-iters", "2", "--eval-interval", "2", "--beta", "0.1"]
    torchrun(2, *common, "--out-dir", tmp_path / "ddp")
    train_run(*common, "--out-dir", tmp_path / "one")
    ddp, one = log(tmp_path / "ddp"), log(tmp_path / "one")
    assert [r["step"] for r in ddp] == [1, 2]
    for a, b in zip(ddp, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["completions/mean_length"] == b["completions/mean_length"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-8)
    assert log(tmp_path / "ddp", "eval")[-1]["val_reward"] == log(tmp_path / "one", "eval")[-1]["val_reward"]


def test_mistakes_are_one_line(base, prompts, tmp_path, capsys):
    run = ["--out-dir", tmp_path / "r", *TINY, "--max-iters", "1"]
    lm = ["--out-dir", tmp_path / "r", *BASIC, "--max-iters", "1"]
    grpo = ["--objective", "grpo", "--init-from", base, "--data", prompts, *run]
    cases = [
        ([*grpo], "--objective grpo: needs --reward"),
        ([*grpo, "--reward", "nosuch"], "--reward 'nosuch': not one of exact, json, bleu"),
        ([*grpo, "--reward", "exact", "--group-size", "1"], "--group-size: must be >= 2"),
        ([*grpo, "--reward", "exact", "--epsilon", "1.5"], "--epsilon: must be in (0, 1)"),
        ([*grpo, "--reward", "exact", "--grpo-loss", "ppo"], "--grpo-loss: 'ppo' is not one of"),
        ([*grpo, "--reward", "exact", "--dpo-loss", "ipo"], "--dpo-loss: does nothing with --objective grpo"),
        (["--data", prompts, *lm, "--group-size", "4"], "--group-size: does nothing with --objective lm"),
        (["--objective", "dpo", "--init-from", base, "--data", prompts, *lm, "--reward", "exact"], "--reward: does nothing with --objective dpo"),
        (["--objective", "grpo", "--data", prompts, *run, "--reward", "exact"], "needs a model to start from"),
        ([*grpo, "--reward", "bleu"], "row 1: --reward bleu needs 'reference' in each row"),
        ([*grpo, "--reward", "exact", "--fsdp"], "not with --fsdp"),
    ]  # fmt: skip
    for argv, message in cases:
        assert message in one_line_error(capsys, train_script.main, *argv)
    other = random_lm(tmp_path / "other", "abc", block=16)
    err = one_line_error(capsys, train_script.main, *grpo, "--reward", "exact", "--reference", other)
    assert f"--reference {other}" in err and "tokenizer" in err
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [*problems(3), {"prompt": "1+x="}, {"answer": "2"}, *problems(30)])
    err = one_line_error(capsys, train_script.main, *grpo[:5], bad, *run, "--reward", "exact")
    assert f"{bad}, row 4: the prompt: 1 character(s) not in the char vocabulary: 'x'" in err
    long = tmp_path / "long.jsonl"
    write_jsonl(long, [{"prompt": "1" * 14, "answer": "1"}])
    err = one_line_error(capsys, train_script.main, *grpo[:5], long, *run, "--reward", "exact")
    assert "row 1: the prompt's 15 tokens and --grpo-max-new-tokens 3 exceed the block size 16" in err
    out = tmp_path / "skip"
    train_run(*grpo[:5], bad, *TINY, "--max-iters", "1", "--reward", "exact", "--skip-bad-rows", "--out-dir", out)
    assert (out / "log.jsonl").exists()


def test_a_resumed_run_is_the_uninterrupted_one(base, prompts, low_digit, tmp_path):
    """The prompts and the completions' sampling are functions of (seed, step, place): a run stopped at step 2
    and resumed to 4 logs the uninterrupted run's losses, rewards and gradient norms bit for bit (the
    reference recorded and reloaded)."""
    common = ["--objective", "grpo", "--init-from", base, "--data", prompts, "--reward", low_digit, *TINY]
    common += ["--eval-interval", "2", "--beta", "0.1", "--lr-schedule", "constant"]  # (the split run: the same LRs)
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "4")
    train_run(*common, "--out-dir", tmp_path / "split", "--max-iters", "2")
    train_run("--resume", tmp_path / "split", "--max-iters", "4")
    keys = ("step", "loss", "grad_norm", "reward", "kl")
    assert [tuple(r[k] for k in keys) for r in log(tmp_path / "split")] == [
        tuple(r[k] for k in keys) for r in log(tmp_path / "full")
    ]


def test_prompts_of_a_chat_checkpoint_go_through_its_template(tmp_path):
    """With a chat checkpoint a text prompt is one user message and messages are rendered as `gpt chat` does,
    ending with the assistant's marker; completions stop at the end-of-turn token. A plain checkpoint's prompt
    starts with the end-of-text token, and messages are a bad row."""
    from gpt.checkpoints import native
    from gpt.data.chat import ChatError, ChatTemplate
    from gpt.data.tokenizer import CharTokenizer
    from gpt.train.prompts import PromptTask

    template = ChatTemplate()
    tok = template.tokenizer(CharTokenizer(DIGITS))
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
    meta = native.build_meta(cfg.to_dict(), tok.spec, chat_template=template.spec)
    plan = SimpleNamespace(resume=None, init=SimpleNamespace(meta=meta))
    task = PromptTask(str(tmp_path / "p.jsonl"), plan)
    msgs = [{"role": "system", "content": "1"}, {"role": "user", "content": "2+2="}]
    assert task.encode({"prompt": msgs}) == template.prompt(msgs, tok)
    assert task.encode({"prompt": "2+2="}) == template.prompt([{"role": "user", "content": "2+2="}], tok)
    assert task.stops == [tok.special(template.end)] and task.checkpoint_meta == {"chat_template": template.spec}
    plain = CharTokenizer(DIGITS)
    meta = native.build_meta(cfg.to_dict(), plain.spec)
    task = PromptTask(str(tmp_path / "p.jsonl"), SimpleNamespace(resume=None, init=SimpleNamespace(meta=meta)))
    assert task.encode({"prompt": "2+2="}) == [plain.eot_token, *plain.encode("2+2=")]
    assert task.stops == [plain.eot_token]
    with pytest.raises(ChatError, match="the checkpoint has no chat template"):
        task.encode({"prompt": msgs})
