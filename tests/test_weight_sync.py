"""Weight sync from a trainer's layout into the serving engine's, on device: colocated (fsdp 8 ->
data 4 x tensor 2 over the same 8 devices) and split (fsdp 4 on devices 0-3 -> data 2 x tensor 2
on 4-7), and LoRA (only the adapters move). After a sync the engine holds, bit for bit, the arrays
a freshly built engine places from the same parameters, and generates the same tokens; the
compiled reshard program's collectives move exactly what each device lacks of its engine shards;
no array is read to the host."""

import contextlib

import jax
import numpy as np
from conftest import ROOT
from flax import nnx

from meshwork.config import load_config
from meshwork.engine.generate import Generator
from meshwork.engine.per_layer import abstract_stacked
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.engine.weight_sync import WeightSync, missing_bytes, shard_bytes
from meshwork.models.build import build_model
from meshwork.models.lora import LoRAParam, add_lora
from meshwork.partitioning import variable_shardings
from meshwork.sharding.hlo import collective_summary
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.rules import rules_for

PROMPTS = [[5, 9, 200, 3], [17, 4], [1, 2, 3, 4, 5, 6, 7], [99]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def small_model(lora: bool = False):
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128"],
    )
    model = build_model(cfg, seed=3)
    if lora:
        add_lora(model, ["q", "v"], rank=4, alpha=8.0, rngs=nnx.Rngs(1))
    return model


def noisy(state: nnx.State, seed: int) -> nnx.State:
    """The trainer's next weights: `state` plus noise large enough to change greedy tokens."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )


def engine_mesh(devices):
    return make_mesh({"data": len(devices) // 2, "tensor": 2}, devices)


def trainer_side(state: nnx.State, devices):
    """(the trainer's params, their shardings): fsdp over `devices`."""
    shardings = variable_shardings(state, make_mesh({"fsdp": len(devices)}, devices), rules_for("fsdp"))
    return jax.device_put(state, shardings), shardings


def same_engine(synced: Generator, graphdef, params: nnx.State, mesh) -> None:
    """The synced engine's arrays and greedy tokens equal a fresh engine's from `params`."""
    fresh = Generator(nnx.merge(graphdef, jax.device_get(params)), mesh=mesh, rules=rules_for("tp"))
    for a, b in zip(jax.tree.leaves(synced.state), jax.tree.leaves(fresh.state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert synced.generate(PROMPTS, GREEDY) == fresh.generate(PROMPTS, GREEDY)


@contextlib.contextmanager
def host_reads():
    """Counts reads of any jax array's host value (`_value`: jax's way to the host, which its
    resharding fallback takes). On CPU the transfer guard does not fire, since the devices' buffers
    are host memory already; this counts the reads themselves."""
    cls = type(jax.numpy.zeros(()))
    original, reads = cls.__dict__["_value"], []

    def read(self):
        reads.append(self.shape)
        return original.fget(self)

    cls._value = property(read)
    try:
        yield reads
    finally:
        cls._value = original


def run_sync(sync: WeightSync, params) -> object:
    with jax.transfer_guard_device_to_host("disallow"), host_reads() as reads:  # the guard: on accelerators
        stats = sync(params)
    assert reads == []  # no array went through the host
    print(stats.line())  # seconds per sync: reported, not asserted
    return stats


def test_colocated_fsdp8_to_data4_tensor2():
    """Same 8 devices: all-to-all over `tensor` then all-gather over `data`. Each device receives
    7/8 of its engine shards (it holds 1/8 of each already), and the compiled program sends
    exactly that: half of what GSPMD's all-gather-then-slice would (7/8 of the whole model)."""
    model = small_model()
    devices = jax.devices()
    mesh = engine_mesh(devices)
    engine = Generator(model, mesh=mesh, rules=rules_for("tp"))
    graphdef, state = nnx.split(model)
    before = engine.generate(PROMPTS, GREEDY)
    params, shardings = trainer_side(noisy(state, 0), devices)

    sync = WeightSync(engine, shardings)
    stats = run_sync(sync, params)
    arrays = jax.tree.leaves(abstract_stacked(engine.state))  # the trainer's structure (layers stacked)
    per_device = sum(shard_bytes(x.shape, x.dtype, x.sharding) for x in arrays)
    assert stats.placement == "colocated" and stats.copied_bytes == 0
    lacking = missing_bytes(arrays, [x.sharding for x in jax.tree.leaves(params)], [x.sharding for x in arrays])
    assert set(lacking.values()) == {per_device * 7 // 8}  # every device: 7/8 of its engine shards
    assert stats.collective_bytes == stats.expected_bytes == per_device * 7 // 8
    # Without the waypoints GSPMD all-gathers every whole weight and slices it: 7/8 of the model.
    plain = jax.jit(lambda p: p, out_shardings=[x.sharding for x in arrays]).lower(jax.tree.leaves(params)).compile()
    whole = sum(x.size * x.dtype.itemsize for x in arrays)
    assert sum(v["bytes"] for v in collective_summary(plain.as_text()).values()) == whole * 7 // 8
    assert stats.engine_bytes == per_device * len(devices)

    same_engine(engine, graphdef, params, mesh)
    assert engine.generate(PROMPTS, GREEDY) != before  # the sync changed what the engine says
    params = trainer_side(noisy(state, 1), devices)[0]
    run_sync(sync, params)  # the next update: the same compiled program, new weights
    same_engine(engine, graphdef, params, mesh)


def test_a_server_is_synced_through_its_generator():
    """A Server's weights are its generator's: the sync swaps them there, and the server serves them."""
    model = small_model()
    devices = jax.devices()
    server = Server(model, mesh=engine_mesh(devices), rules=rules_for("tp"), slots=4, page_size=8, max_len=64)
    graphdef, state = nnx.split(model)
    params, shardings = trainer_side(noisy(state, 4), devices)
    run_sync(WeightSync(server, shardings), params)
    fresh = Generator(nnx.merge(graphdef, jax.device_get(params)), mesh=engine_mesh(devices), rules=rules_for("tp"))
    results = server.run([Request(i, p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert [results[i].tokens for i in range(len(PROMPTS))] == fresh.generate(PROMPTS, GREEDY)


def test_split_trainer_0_3_engine_4_7():
    """Disjoint devices: the trainer's program reshards onto the engine's layout over devices 0-3
    (3/4 of each shard is missing there: fsdp 4 -> data 2 x tensor 2), then each shard is copied to
    the engine device with the same index: exactly the engine layout's bytes cross over."""
    model = small_model()
    devices = jax.devices()
    mesh = engine_mesh(devices[4:])
    engine = Generator(model, mesh=mesh, rules=rules_for("tp"))
    graphdef, state = nnx.split(model)
    params, shardings = trainer_side(noisy(state, 2), devices[:4])

    sync = WeightSync(engine, shardings)
    stats = run_sync(sync, params)
    arrays = jax.tree.leaves(abstract_stacked(engine.state))
    per_device = sum(shard_bytes(x.shape, x.dtype, x.sharding) for x in arrays)
    assert stats.placement == "split"
    assert stats.copied_bytes == stats.engine_bytes == 4 * per_device
    assert stats.collective_bytes == stats.expected_bytes == per_device * 3 // 4
    assert {d.id for x in jax.tree.leaves(engine.state) for d in x.sharding.device_set} == {4, 5, 6, 7}
    same_engine(engine, graphdef, params, mesh)


def test_a_direct_device_put_across_device_sets_goes_through_the_host():
    """Why the split sync reshards first: jax's device_put from fsdp 4 on 0-3 into tensor-sharded
    shards on 4-7 finds no source shard with each target's index and reads the array to the host."""
    x = jax.device_put(np.ones((8, 8), np.float32), variable_shardings_1d(jax.devices()[:4], "fsdp", 0))
    target = variable_shardings_1d(jax.devices()[4:], "tensor", 1)
    with host_reads() as reads:
        y = jax.device_put(x, target)
    assert reads == [(8, 8)]
    np.testing.assert_array_equal(np.asarray(y), 1.0)


def variable_shardings_1d(devices, axis: str, dim: int):
    mesh = make_mesh({axis: len(devices)}, devices)
    spec = [None, None]
    spec[dim] = axis
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def test_lora_moves_only_the_adapters():
    """The engine holds base and adapters unmerged; only the LoRA factors move (their bytes, not the
    model's), and the engine equals a fresh one built with the same adapters."""
    model = small_model(lora=True)
    devices = jax.devices()
    mesh = engine_mesh(devices)
    engine = Generator(model, mesh=mesh, rules=rules_for("tp"))
    graphdef, state = nnx.split(model)
    adapters, rest = nnx.split_state(state, LoRAParam, ...)
    params, shardings = trainer_side(noisy(adapters, 3), devices)

    sync = WeightSync(engine, shardings, kind=LoRAParam)
    stats = run_sync(sync, params)
    lora = jax.tree.leaves(nnx.filter_state(abstract_stacked(engine.state), LoRAParam))
    everything = jax.tree.leaves(abstract_stacked(engine.state))
    assert stats.leaves == len(lora) == 4  # A and B of q and of v, the layers stacked in each
    assert stats.engine_bytes == sum(shard_bytes(x.shape, x.dtype, x.sharding) * 8 for x in lora)
    assert stats.engine_bytes < sum(shard_bytes(x.shape, x.dtype, x.sharding) * 8 for x in everything) // 10
    assert stats.collective_bytes == stats.expected_bytes > 0
    assert len(jax.tree.leaves(sync.program.args_info)) == 4  # the program takes the adapters alone
    # A is (layers, embed, r): fsdp splits it, 7/8 of it is missing everywhere; B has no embed dim,
    # so the trainer replicates it and every device slices its tensor shard locally.
    a_bytes = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(engine.state) if "lora_a" in str(path))
    assert stats.collective_bytes == stats.expected_bytes == a_bytes * 7 // 8
    same_engine(engine, graphdef, nnx.merge_state(rest, params), mesh)
