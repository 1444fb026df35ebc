"""min_p, logit_bias and the presence / frequency penalties: the same numbers as llama.cpp's own samplers
(llama-cpp-python's bindings of `llama_sampler_init_min_p`, `_penalties`, `_logit_bias`), and through
`gpt sample` and the server."""

import ctypes

import pytest
import torch

from gpt.cli import sample as sample_cli
from gpt.infer.logits import apply_logit_bias, apply_presence_frequency, min_p_filter, next_token
from gpt.infer.sampling import SampleConfig, SamplingError, complete
from tests.conftest import one_line_error

llama = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the dev extra)")


def llama_applies(logits: torch.Tensor, sampler, accepted=()) -> torch.Tensor:
    """llama.cpp's `sampler` applied to logits (V,), after it accepted the ids `accepted`: the logits it leaves,
    -inf where it dropped an id."""
    V = len(logits)
    data = (llama.llama_token_data * V)(*(llama.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)))
    candidates = llama.llama_token_data_array(data, V, -1, False)
    try:
        for token in accepted:
            llama.llama_sampler_accept(sampler, token)
        llama.llama_sampler_apply(sampler, ctypes.byref(candidates))
    finally:
        llama.llama_sampler_free(sampler)
    out = torch.full((V,), float("-inf"))
    for j in range(candidates.size):
        out[data[j].id] = data[j].logit
    return out


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_min_p_drops_what_llama_cpp_drops(p):
    logits = torch.randn(300) * 3
    theirs = llama_applies(logits, llama.llama_sampler_init_min_p(p, 1))
    torch.testing.assert_close(min_p_filter(logits[None], p)[0], theirs)


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.5), (0.7, 0.0), (-0.4, 1.3), (2.0, -2.0)])
def test_presence_and_frequency_penalties_equal_llama_cpp(presence, frequency):
    logits = torch.randn(64)
    generated = torch.randint(0, 64, (40,))
    # llama.cpp counts the last penalty_last_n accepted ids; the second int is an older header's n_vocab,
    # which the bindings still declare (an extra integer argument the library does not read)
    sampler = llama.llama_sampler_init_penalties(64, 64, 1.0, frequency, presence)
    theirs = llama_applies(logits, sampler, generated.tolist())
    ours = apply_presence_frequency(logits[None], generated[None], presence, frequency)[0]
    torch.testing.assert_close(ours, theirs)


def test_logit_bias_equals_llama_cpp_and_bans_or_forces_a_token():
    logits = torch.randn(2, 64)
    bias = ((3, 5.0), (4, -100.0), (60, 0.25))
    entries = (llama.llama_logit_bias * 3)(*(llama.llama_logit_bias(t, b) for t, b in bias))
    theirs = llama_applies(logits[1], llama.llama_sampler_init_logit_bias(64, 3, entries))
    torch.testing.assert_close(apply_logit_bias(logits, bias)[1], theirs)
    assert next_token(logits, temperature=0, logit_bias=((7, 100.0),)).tolist() == [7, 7]
    banned = next_token(logits.repeat(200, 1), temperature=1.5, logit_bias=((3, -100.0),), uniforms=None)
    assert 3 not in banned.tolist()


def test_penalties_count_only_the_sample_so_far():
    logits = torch.zeros(1, 10)
    prev = torch.tensor([[5, 5, 5, 2, 2]])  # a prompt of three 5s, then two generated 2s
    out = next_token(logits, temperature=0, prev_ids=prev, generated=2, frequency_penalty=1.0, top_k=None)
    assert out.item() == 0  # 2 is lowered, 5 (the prompt's) is not: the argmax is the first untouched id
    penalised = apply_presence_frequency(logits, prev[:, -2:], 0.5, 1.0)
    assert penalised[0, 2].item() == -2.5 and penalised[0, 5].item() == 0


def test_bad_settings_are_one_sampling_error():
    for bad in (dict(min_p=1.5), dict(presence_penalty=3), dict(frequency_penalty="x"), dict(logit_bias=((1, 200),))):
        with pytest.raises(SamplingError):
            SampleConfig(**bad)
    with pytest.raises(SamplingError, match="token id 70 is not in the vocabulary"):
        SampleConfig(logit_bias=((70, 1.0),)).check_vocab(66)


def test_sample_cli_applies_logit_bias_and_refuses_a_bad_one(trained_run, capsys):
    from gpt import load_checkpoint

    model, tok, _ = load_checkpoint(trained_run)
    z = tok.encode("z")[0]
    assert complete(model, tok, "ROMEO:", max_new_tokens=6, temperature=0, logit_bias=((z, 100.0),)) == ["zzzzzz"]
    code = sample_cli.main(
        ["--ckpt", str(trained_run), "--prompt", "A", "--max-new-tokens", "5", "--temperature", "0"]
        + ["--logit-bias", f"{z}=100", "--min-p", "0.05", "--frequency-penalty", "0.1", "--device", "cpu"]
    )
    assert code == 0 and "Azzzzz" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's own exit, with one line
        sample_cli.main(["--ckpt", str(trained_run), "--logit-bias", "z=1"])
    err = capsys.readouterr().err
    assert "--logit-bias: expected ID=BIAS" in err and "Traceback" not in err
    err = one_line_error(capsys, sample_cli.main, "--ckpt", trained_run, "--logit-bias", "9999=1", "--device", "cpu")
    assert "9999 is not in the vocabulary" in err
