"""The (data, pipeline, model) mesh: "model" innermost, data=-1 takes the remaining devices, bad sizes refused."""

import jax
import pytest

from mtx.parallel import make_mesh


def test_data_minus_one_takes_the_remaining_devices():
    mesh = make_mesh(-1, 1, 2)
    assert mesh.axis_names == ("data", "pipeline", "model")
    assert dict(mesh.shape) == {"data": 4, "pipeline": 1, "model": 2}


def test_model_is_the_innermost_axis():
    mesh = make_mesh(2, 1, 4)
    ids = [[d.id for d in row] for row in mesh.devices[:, 0, :]]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]  # consecutive devices share a tensor-parallel group


# the simulated devices' count is named with the XLA_FLAGS that set it (tests/conftest.py sets 8)
FLAG = r" \(XLA_FLAGS --xla_force_host_platform_device_count=8\)"


@pytest.mark.parametrize("sizes,needle", [((-1, 1, 3), "8 devices" + FLAG + " are not divisible"),
                                          ((2, 1, 8), "only 8 exist" + FLAG),
                                          ((1, 1, 0), "--tensor-model-parallel-size")])
def test_impossible_sizes_are_refused(sizes, needle):
    with pytest.raises(ValueError, match=needle):
        make_mesh(*sizes)


def test_sub_mesh_of_the_first_devices():
    mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
    assert mesh.size == 2
