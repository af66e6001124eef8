"""The examples in the sharding helpers' docstrings run and say what they claim."""

import doctest

import pytest

import sharding.hlo
import sharding.mesh
import sharding.report
import sharding.rules


@pytest.mark.parametrize("module", [sharding.mesh, sharding.rules, sharding.report, sharding.hlo], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_unknown_logical_axis_is_an_error_not_replication():
    with pytest.raises(KeyError, match="no rule"):
        sharding.rules.logical_to_spec(("embed", "made_up"), sharding.rules.rules_for("dp"))


def test_mesh_sizes_must_cover_the_devices():
    with pytest.raises(sharding.mesh.MeshSizeError, match="multiply to 8"):
        sharding.mesh.resolve_mesh_shape({"data": 3}, 8)
    with pytest.raises(sharding.mesh.MeshSizeError, match="does not divide"):
        sharding.mesh.resolve_mesh_shape({"data": 3, "fsdp": -1}, 8)
    assert sharding.mesh.resolve_mesh_shape({"fsdp": -1, "tensor": 2}, 8) == (1, 1, 4, 1, 1, 2)
