"""The examples in the sharding helpers' docstrings run and say what they claim."""

import doctest

import pytest

import meshwork.sharding.hlo
import meshwork.sharding.hlo_kernels
import meshwork.sharding.hlo_parse
import meshwork.sharding.jaxpr_ops
import meshwork.sharding.mesh
import meshwork.sharding.parallel
import meshwork.sharding.report
import meshwork.sharding.rules
import meshwork.sharding.shard_map_util


@pytest.mark.parametrize(
    "module",
    [
        meshwork.sharding.mesh,
        meshwork.sharding.rules,
        meshwork.sharding.parallel,
        meshwork.sharding.report,
        meshwork.sharding.hlo,
        meshwork.sharding.hlo_parse,
        meshwork.sharding.hlo_kernels,
        meshwork.sharding.jaxpr_ops,
        meshwork.sharding.shard_map_util,
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_unknown_logical_axis_is_an_error_not_replication():
    with pytest.raises(KeyError, match="no rule"):
        meshwork.sharding.rules.logical_to_spec(("embed", "made_up"), meshwork.sharding.rules.rules_for("dp"))


def test_mesh_sizes_must_cover_the_devices():
    with pytest.raises(meshwork.sharding.mesh.MeshSizeError, match="multiply to 8"):
        meshwork.sharding.mesh.resolve_mesh_shape({"data": 3}, 8)
    with pytest.raises(meshwork.sharding.mesh.MeshSizeError, match="does not divide"):
        meshwork.sharding.mesh.resolve_mesh_shape({"data": 3, "fsdp": -1}, 8)
    assert meshwork.sharding.mesh.resolve_mesh_shape({"fsdp": -1, "tensor": 2}, 8) == (1, 1, 4, 1, 1, 2)
