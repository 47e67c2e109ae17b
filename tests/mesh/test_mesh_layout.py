"""Mesh construction: axis order, the -1 wildcard, sub-meshes and the one-line errors."""
import jax
import pytest

from mesh import AXES, MeshConfigError, make_mesh, resolve_axis_sizes


def test_axes_outermost_first_and_wildcard():
    mesh = make_mesh({"data": -1, "tensor": 2})
    assert mesh.axis_names == AXES == ("data", "pipeline", "fsdp", "expert", "context", "tensor")
    assert dict(zip(mesh.axis_names, mesh.devices.shape)) == {"data": 4, "pipeline": 1, "fsdp": 1, "expert": 1,
                                                                   "context": 1, "tensor": 2}
    # tensor is innermost: neighbours on the tensor axis are consecutive devices
    assert [d.id for d in mesh.devices[0, 0, 0, 0, 0, :]] == [0, 1]


def test_first_n_devices():
    mesh = make_mesh({}, num_devices=1)
    assert mesh.devices.size == 1 and mesh.devices.flat[0] == jax.devices()[0]
    assert make_mesh({"fsdp": 2, "tensor": 2}, num_devices=4).devices.size == 4


@pytest.mark.parametrize("sizes, fragment", [
    ({"data": 3}, "mesh: data=3 needs 3 devices but 8 are available"),
    ({"data": -1, "tensor": -1}, "mesh.data and mesh.tensor are both -1"),
    ({"fsdp": 0}, "mesh.fsdp=0"),
    ({"tensor": -4}, "mesh.tensor=-4"),
    ({"sequence": 2}, "mesh.sequence: unknown mesh axis"),
    ({"data": -1, "tensor": 3}, "mesh.data=-1"),
])
def test_errors_are_one_line_and_name_the_setting(sizes, fragment):
    with pytest.raises(MeshConfigError) as info:
        resolve_axis_sizes(sizes, 8)
    message = str(info.value)
    assert fragment in message and "\n" not in message
