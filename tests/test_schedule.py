import pytest

from gpt.train.schedule import get_lr, get_wd, noam_lr


@pytest.mark.parametrize(
    "step,expected",
    [
        (1, 512**-0.5 * 4000**-1.5),  # warm-up: linear in step
        (2000, 512**-0.5 * 2000 * 4000**-1.5),
        (4000, (512 * 4000) ** -0.5),  # the peak, where both branches meet
        (16000, 512**-0.5 * 16000**-0.5),  # decay: 1/sqrt(step), half the peak at 4x warmup
    ],
)
def test_noam_lr_table(step, expected):
    assert noam_lr(step, d_model=512, warmup=4000) == pytest.approx(expected, rel=1e-12)


def test_noam_lr_shape():
    lrs = [noam_lr(s, 512, 4000) for s in range(0, 20001, 100)]
    peak = max(lrs)
    assert peak == pytest.approx(noam_lr(4000, 512, 4000)) == pytest.approx(7.0e-4, rel=0.01)
    i = lrs.index(peak)
    assert all(a < b for a, b in zip(lrs[1:i], lrs[2 : i + 1]))  # rises to the peak
    assert all(a > b for a, b in zip(lrs[i:], lrs[i + 1 :]))  # then falls
    assert noam_lr(16000, 512, 4000) == pytest.approx(peak / 2)
    assert noam_lr(0, 512, 4000) == noam_lr(1, 512, 4000) > 0  # a 0-based trainer loses no step
    assert noam_lr(100, 512, 4000, scale=2.0) == 2 * noam_lr(100, 512, 4000)


def test_noam_lr_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup=0"):
        noam_lr(1, 512, 0)


def test_lr_schedule_table():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    table = {  # step: (cosine, constant, wsd)
        0: (1 / 11, 1 / 11, 1 / 11),
        9: (10 / 11, 10 / 11, 10 / 11),
        10: (1.0, 1.0, 1.0),
        60: (0.55, 1.0, 1.0),
        88: (None, 1.0, 1.0),
        99: (None, 1.0, 1.0 - 0.9 * 11 / 22),
        110: (0.1, 1.0, 0.1),
        500: (0.1, 1.0, 0.1),
    }
    for step, expected in table.items():
        for schedule, value in zip(("cosine", "constant", "wsd"), expected):
            if value is not None:
                assert get_lr(step, schedule=schedule, **kw) == pytest.approx(value), (schedule, step)
    # cosine decays monotonically after warmup
    values = [get_lr(s, schedule="cosine", **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_noam_schedule_counts_the_first_step_as_the_papers_step_one():
    d, w = 512, 4000
    assert get_lr(w - 1, schedule="noam", lr=1.0, warmup_iters=w, d_model=d) == pytest.approx((d * w) ** -0.5)
    assert get_lr(99, schedule="noam", lr=2.0, warmup_iters=w, d_model=d) == pytest.approx(2 * noam_lr(100, d, w))


def test_weight_decay_schedule_table():
    table = {  # step: (constant, linear, cosine) of wd 0.2 over 100 steps
        0: (0.2, 0.2, 0.2),
        25: (0.2, 0.15, 0.1 * (1 + 2**-0.5)),
        50: (0.2, 0.1, 0.1),
        100: (0.2, 0.0, 0.0),
        300: (0.2, 0.0, 0.0),  # past the decay's end: stays at 0
    }
    for step, expected in table.items():
        for schedule, value in zip(("constant", "linear", "cosine"), expected):
            assert get_wd(step, schedule=schedule, wd=0.2, decay_iters=100) == pytest.approx(value, abs=1e-12)
    with pytest.raises(ValueError, match="unknown weight decay schedule 'step'"):
        get_wd(0, schedule="step", wd=0.1)
