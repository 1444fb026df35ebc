"""The processes' layout (gpt/train/mesh.py): every rank has one place in pp x dp x tp, tensor parallel
innermost; layouts that do not divide the world are one line."""

import pytest

from gpt.errors import ConfigError
from gpt.train.mesh import Layout


def test_layout_takes_data_parallel_from_what_is_left():
    assert Layout.of(8, tp=2, pp=2) == Layout(pp=2, dp=2, tp=2)
    assert Layout.of(4, tp=2) == Layout(pp=1, dp=2, tp=2)
    assert Layout.of(1) == Layout()


def test_each_rank_has_its_own_coordinates_tp_innermost():
    layout = Layout.of(8, tp=2, pp=2)
    places = [layout.coordinates(r) for r in range(8)]
    assert len(set(places)) == 8
    assert places[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]  # neighbours share a layer's matrices
    assert places[4] == (1, 0, 0)


@pytest.mark.parametrize(
    "world, tp, pp, words",
    [(6, 4, 1, "--tp 4 x --pp 1 = 4 does not divide the 6"), (4, 0, 1, "--tp: must be >= 1"), (8, 3, 2, "= 6")],
)
def test_layout_that_does_not_divide_the_world_is_refused(world, tp, pp, words):
    with pytest.raises(ConfigError, match=words):
        Layout.of(world, tp=tp, pp=pp)
