"""The 1F1B and interleaved timetables (mtx/parallel/one_f_one_b.py): every slot obeys the dependencies, memory does
not grow with the microbatches, the bubble is the schedule's ideal, and the audit counts the two shifts a tick."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.extend.core import Literal

from mtx.config import Config
from mtx.parallel import make_mesh
from mtx.parallel.pipeline import Schedule
from mtx.parallel.sharded import is_stacked, partition_specs, split_abstract
from mtx.presets import load_preset
from mtx.sharded_model import build_model
from mtx.step import TrainStep

DEEP = Config().replace(**load_preset("configs/tiny.toml")).replace(num_layers=8, hidden_dropout=0.0,
                                                                    attention_dropout=0.0, vocab_size=257)


@pytest.mark.parametrize("p,v,m", [(2, 1, 8), (4, 1, 3), (2, 2, 8), (4, 2, 8), (4, 3, 5), (8, 1, 1)])
def test_timetable_runs_every_slot_once_in_dependency_order(p, v, m):
    schedule = Schedule((1,) * (p * v), m, v, "interleaved" if v > 1 else "1f1b")
    table = schedule.timetable()
    fwd, bwd = {}, {}
    for t in range(schedule.ticks):
        for s in range(p):
            if table["fwd_mb"][t, s] >= 0:
                fwd[table["fwd_mb"][t, s], table["fwd_chunk"][t, s] * p + s] = t
            if table["bwd_mb"][t, s] >= 0:
                bwd[table["bwd_mb"][t, s], table["bwd_chunk"][t, s] * p + s] = t
    stages = range(p * v)
    assert set(fwd) == set(bwd) == {(i, k) for i in range(m) for k in stages}
    for i in range(m):
        for k in stages:
            if k:  # a forward one tick after the previous virtual stage's: what that device sent last tick
                assert fwd[i, k] == fwd[i, k - 1] + 1
            if k < p * v - 1:  # a backward one tick after the next virtual stage's
                assert bwd[i, k] == bwd[i, k + 1] + 1
        assert bwd[i, p * v - 1] == fwd[i, p * v - 1]  # the loss: forward and backward in one tick
    # stage inputs alive at a tick (its forward's and its backward's included), per device: never more than the
    # ring holds (Schedule.in_flight's bound, <= 2 P V - 1, reached once M >= 2 P V); each (microbatch, chunk) has
    # one ring slot of its chunk's, written by its forward, read by its backward, and no other forward writes that
    # slot in between
    chunk_of_slot, fwd_slot, bwd_slot = schedule.ring()
    bound = p * v + p * -(-v // 2) - v % 2
    assert schedule.in_flight == len(chunk_of_slot) <= bound <= 2 * p * v - 1
    assert m < 2 * p * v or schedule.in_flight == bound
    for s in range(p):
        for t in range(schedule.ticks):
            alive = sum(fwd[i, k] <= t <= bwd[i, k] for i in range(m) for k in stages if k % p == s)
            assert alive <= schedule.in_flight
    for (i, k), t_f in fwd.items():
        s, slot = k % p, fwd_slot[t_f, k % p]
        assert slot >= 0 and bwd_slot[bwd[i, k], s] == slot and chunk_of_slot[slot] == k // p
        assert not (fwd_slot[t_f + 1:bwd[i, k] + 1, s] == slot).any()
    assert ((fwd_slot >= 0) == (table["fwd_mb"] >= 0)).all() and ((bwd_slot >= 0) == (table["bwd_mb"] >= 0)).all()
    if m % p == 0:
        assert schedule.bubble == pytest.approx((p - 1) / (v * m + p - 1))


def _temp_bytes(schedule, m, p=2):
    cfg = DEEP.replace(pipeline_model_parallel_size=p, tensor_model_parallel_size=1, data_parallel_size=1,
                       micro_batch_size=2, global_batch_size=2 * m, pipeline_schedule=schedule).validate(8)
    step = TrainStep.build(cfg, make_mesh(1, p, 1, devices=jax.devices()[:p]))
    tokens = jax.ShapeDtypeStruct((2 * m, cfg.model.seq_length + 1), np.int32, sharding=step.model.batch_sharding)
    return jax.jit(step._train_step).lower(step.abstract_state(), tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_memory_does_not_grow_with_microbatches(p):
    """The compiled step's temporaries at M = 4, 8, 16: with 1F1B flat within 10% once M >= 2 P - 1 (the ring's
    most slots; below that the ring holds M: less), growing with GPipe."""
    one_f_one_b = [_temp_bytes("1f1b", m, p) for m in (4, 8, 16)]
    bounded = [b for m, b in zip((4, 8, 16), one_f_one_b) if m >= 2 * p - 1]
    assert max(bounded) < 1.1 * min(bounded) and max(one_f_one_b) == max(bounded), one_f_one_b
    if p == 2:
        gpipe = [_temp_bytes("gpipe", m, p) for m in (4, 16)]
        assert gpipe[1] > 1.5 * gpipe[0] and gpipe[1] > one_f_one_b[2], (gpipe, one_f_one_b)


def test_audit_counts_two_shifts_a_tick():
    from mtx.audit import audit_config, audit_pipeline

    b, s, h = 2, 32, 64
    for v in (1, 2):
        cfg = audit_config(hidden_size=h, num_attention_heads=8, seq_length=s, micro_batch_size=b,
                           tensor_model_parallel_size=2, data_parallel_size=1, pipeline_model_parallel_size=2,
                           virtual_pipeline_model_parallel_size=v, num_microbatches=4, num_devices=4)
        report = audit_pipeline(cfg)
        ticks = 4 * v + 2 * v + 2 - 2
        assert report["schedule"]["ticks"] == ticks
        # The head, spread over the stages by vocabulary, once a microbatch: the last stage's output sent to the
        # other stage and the gradient wrt it sent back (b s h each, point to point: no all-reduce of the output);
        # the loss's max, sum of exponentials and target logit (b s each) over the stages' and model ranks'
        # vocabulary slices.
        assert report["per_step"] == {"forward and backward": {"collective-permute pipeline": 2 * ticks,
                                                               "elements_each": [b * s * h]},
                                      "head": {"collective-permute pipeline": 2 * 4, "all-reduce pipeline,model": 3 * 4,
                                               "elements_each": [b * s, b * s * h]}}
        # Interleaved: device s holds chunks s and s + 2 of 4 layers stored [0 1 | 2 3], so each device receives one
        # layer from the other (every stacked parameter), and sends its gradient back.
        exchange = report["layer_exchange"]
        specs = partition_specs(split_abstract(build_model(cfg))[1], cfg.parallel.tensor_model_parallel_size)
        stacked = [spec for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) if is_stacked(spec)]
        assert exchange["collective-permute pipeline"] == (2 * len(stacked) if v == 2 else 0)
        assert report["schedule"]["ideal_bubble"] == pytest.approx(1 / (4 * v + 1))


@pytest.mark.parametrize("recompute,per_layer", [("full", 1), ("matmuls", None), (None, None)])
def test_1f1b_keeps_activations_only(monkeypatch, recompute, per_layer):
    """What a forward slot keeps for its backward is activations (micro batch x sequence leading dims), never a copy of
    the parameters or of their slices and casts; with `full` recomputation, one (B, S, D) input per layer."""
    import mtx.parallel.one_f_one_b as one_f_one_b

    kept_avals = []
    split = one_f_one_b._Residuals.split
    monkeypatch.setattr(one_f_one_b._Residuals, "split",
                        lambda self, *a: kept_avals.append(split(self, *a)) or kept_avals[-1])
    cfg = DEEP.replace(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, data_parallel_size=1,
                       micro_batch_size=2, global_batch_size=8, recompute_granularity=recompute).validate(8)
    step = TrainStep.build(cfg, make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    tokens = jax.ShapeDtypeStruct((8, cfg.model.seq_length + 1), np.int32, sharding=step.model.batch_sharding)
    jax.jit(step._train_step).lower(step.abstract_state(), tokens)
    kept = [leaf for leaf in kept_avals[-1] if leaf.ndim > 0]  # (the microbatch and chunk indices are scalars)
    b, s, d = 2, cfg.model.seq_length, cfg.model.hidden_size
    activation = lambda shape: any(shape[i] == b and {s, s + 1} & set(shape[i + 1:i + 3])
                                   for i in range(len(shape) - 1))
    assert kept and not [leaf.shape for leaf in kept if not activation(leaf.shape)]
    if per_layer:  # each layer's input (stacked when the layers are scanned); the token ids aside
        floats = sum(leaf.size for leaf in kept if jnp.issubdtype(leaf.dtype, jnp.floating))
        assert floats == cfg.model.num_layers // 2 * per_layer * b * s * d


@pytest.mark.parametrize("counts,v", [((10, 10, 10, 10), 2), ((21, 19), 1), ((3, 2, 2, 1), 2), ((2, 3), 1),
                                      ((1, 2, 1, 3, 2, 1), 2), ((2, 1, 3, 2, 1, 3, 2, 2), 2), ((3, 1, 2, 2), 1)])
def test_slot_exchange_fills_every_slot_moving_only_other_devices_layers(counts, v):
    """SlotExchange's plan, run on numpy: each device's slots get exactly Schedule.slot_layers, and the only rows sent
    are layers a device needs from another (the stack stored in contiguous blocks, or whole when P does not divide
    L)."""
    from mtx.parallel.pipeline import SlotExchange

    schedule = Schedule(counts, 4, v, "interleaved" if v > 1 else "1f1b")
    layers, p = sum(counts), schedule.stages
    rows = layers // p if layers % p == 0 else layers
    plan = SlotExchange.plan(schedule, rows)
    stored = [np.arange(layers)[d * rows:(d + 1) * rows] if rows != layers else np.arange(layers) for d in range(p)]
    slots = []
    for d in range(p):
        received = [stored[(d - o) % p][sends[(d - o) % p]] for o, sends in enumerate(plan.sends, start=1)]
        slots.append(np.concatenate([stored[d], *received])[plan.gather[d]])
    np.testing.assert_array_equal(np.concatenate(slots), schedule.slot_layers())
    for d in range(p):  # what a device fills from received rows is exactly what it does not store
        received = plan.gather[d] >= len(stored[d])
        assert set(slots[d][received]) == set(slots[d]) - set(stored[d])
    for o, sends in enumerate(plan.sends, start=1):  # each send as wide as the most slots a device fills from o back
        filled = [np.sum((plan.gather[d] >= len(stored[d])) & np.isin(slots[d], stored[(d - o) % p]))
                  for d in range(p)]
        assert sends.shape[1] == max(filled)
    if counts == (21, 19):  # device 0 needs layer 20 from device 1, device 1 nothing: one row each way, padded
        assert [sends.shape for sends in plan.sends] == [(2, 1)]
    if rows == layers:  # stored whole: nothing moves
        assert all(sends.size == 0 for sends in plan.sends)


def test_lockstep_shifts_each_value_one_device_along_the_ring_per_tick():
    """The tick primitive every schedule runs on: what a tick sends NEXT arrives at stage s + 1 (the last stage's at
    stage 0), what it sends PREVIOUS at stage s - 1, in time for the next tick; the carry and the outs are the
    work's."""
    from mtx.parallel.mesh import PIPELINE
    from mtx.parallel.pipeline import NEXT, PREVIOUS, lockstep

    p, ticks = 4, 6
    mesh = make_mesh(1, p, 1, devices=jax.devices()[:p])

    def run(stage_1):
        stage = stage_1[0]

        def work(t, received, carry):  # pass on what arrived; tick 0 sends the stage's own index
            fwd, bwd = (jnp.where(t == 0, stage, r) for r in received)
            return (fwd, bwd), carry + 1, jnp.stack([fwd, bwd])

        zero = jnp.zeros_like(stage)
        count, outs = lockstep(work, (zero, zero), zero, ticks, (NEXT, PREVIOUS))
        return count[None], outs[None]

    stages = jax.device_put(jnp.arange(p, dtype=jnp.int32), jax.sharding.NamedSharding(mesh, P(PIPELINE)))
    count, outs = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(PIPELINE), out_specs=P(PIPELINE)))(stages)
    count, outs = np.asarray(count), np.asarray(outs)
    np.testing.assert_array_equal(count, [ticks] * p)
    for s in range(p):
        for t in range(ticks):  # after t shifts, stage s holds the index of stage s - t (NEXT) and s + t (PREVIOUS)
            assert outs[s, t].tolist() == [(s - t) % p, (s + t) % p]


def test_the_last_stage_sends_its_value_to_each_stage_and_gets_the_gradients_back():
    """The spread head's input: the last stage's value on every stage, by sends of one pair (no all-reduce, forward
    or backward); its pullback sums every stage's cotangent on the last stage, in the value's dtype (bf16 here), and
    gives the other stages' own values none."""
    from mtx.parallel.mesh import PIPELINE
    from mtx.parallel.pipeline import last_stage_to_each

    p = 4
    mesh = make_mesh(1, p, 1, devices=jax.devices()[:p])
    x = jnp.arange(p * 3, dtype=jnp.bfloat16).reshape(p, 3)
    ct = (x + 1) * jnp.asarray([1, 2, 4, 8], jnp.bfloat16)[:, None]  # sums of integers below 256: exact in bf16
    x_np, ct_np = np.asarray(x, np.float32), np.asarray(ct, np.float32)
    x, ct = (jax.device_put(a, jax.sharding.NamedSharding(mesh, P(PIPELINE))) for a in (x, ct))

    def run(x, ct):
        y, pullback = jax.vjp(last_stage_to_each, x)
        return y, pullback(ct)[0]

    shard = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(PIPELINE), out_specs=P(PIPELINE)))
    y, dx = shard(x, ct)
    assert dx.dtype == jnp.bfloat16
    y, dx = np.asarray(y, np.float32), np.asarray(dx, np.float32)
    np.testing.assert_array_equal(y, np.tile(x_np[-1:], (p, 1)))
    np.testing.assert_array_equal(dx[:-1], 0)
    np.testing.assert_array_equal(dx[-1], ct_np.sum(0))
    hlo = shard.lower(x, ct).compile().as_text()
    assert "all-reduce" not in hlo and hlo.count("collective-permute") >= 2 * (p - 1)


def test_the_tick_loop_adds_only_a_chunks_rows_of_the_layer_gradients():
    """A backward slot's layer gradients are zero outside its chunk's rows of the device's stack (the transpose of the
    chunk's static slice pads them), the head's zero throughout: the tick loop adds a chunk's rows in place and never
    a whole stack-shaped gradient to the accumulator (which would read and write every row each time), reading and
    writing those rows at one traced index (XLA's GPU backend rewrites the whole stack for a static slice and update
    at constants)."""
    cfg = DEEP.replace(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, data_parallel_size=1,
                       micro_batch_size=2, global_batch_size=8, virtual_pipeline_model_parallel_size=2).validate(8)
    step = TrainStep.build(cfg, make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    tokens = jax.ShapeDtypeStruct((8, cfg.model.seq_length + 1), np.int32, sharding=step.model.batch_sharding)
    ticks = _scan_body(jax.make_jaxpr(step._train_step)(step.abstract_state(), tokens).jaxpr, step.model.pipeline.ticks)
    eqns = _eqns(ticks)
    padded = {tuple(e.outvars[0].aval.shape) for e in eqns
              if e.primitive.name == "pad" and e.params["padding_config"][0][:2] != (0, 0)}
    assert padded  # the chunks' slices are transposed (the stack has 2 chunks a device)
    assert not [e for e in eqns if e.primitive.name == "add" and tuple(e.outvars[0].aval.shape) in padded]
    # The rows' index along the stack: dynamic_slice(stack, i, ...), dynamic_update_slice(stack, rows, i, ...).
    row_index = {"dynamic_slice": 1, "dynamic_update_slice": 2}
    indices = [(e.primitive.name, e.invars[row_index[e.primitive.name]]) for e in eqns
               if e.primitive.name in row_index and tuple(e.invars[0].aval.shape) in padded]
    assert {name for name, _ in indices} == set(row_index)
    assert not [i for _, i in indices if isinstance(i, Literal)]


def _scan_body(jaxpr, length: int):
    """The body of the scan of `length` steps in a traced jaxpr (looked for inside jit, shard_map, branches)."""
    return next(e.params["jaxpr"].jaxpr for e in _eqns(jaxpr)
                if e.primitive.name == "scan" and e.params["length"] == length)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (branches, calls)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _eqns(sub)
    return out


def _interleaved_step(recompute):
    """The tiny model's interleaved 1F1B step (P 2, V 2, layers unrolled, 4 microbatches) -> (config, step,
    abstract tokens)."""
    cfg = DEEP.replace(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, data_parallel_size=1,
                       micro_batch_size=2, global_batch_size=8, virtual_pipeline_model_parallel_size=2,
                       recompute_granularity=recompute, scan_layers=False).validate(8)
    step = TrainStep.build(cfg, make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    return cfg, step, jax.ShapeDtypeStruct((8, cfg.model.seq_length + 1), np.int32, sharding=step.model.batch_sharding)


@pytest.mark.parametrize("recompute", ["matmuls", "full"])
def test_1f1b_recomputes_layers_without_a_barrier_on_their_weights(recompute):
    """A chunk's backward recomputes its layers without jax.checkpoint's barrier against CSE (the forward it repeats
    is in another branch of the tick): no optimization barrier of the lowered step takes one layer's parameter,
    which XLA copied out of the stack ahead of every backward (docs/benchmarks.md 4k); the stacked ones may."""
    cfg, step, tokens = _interleaved_step(recompute)
    text = jax.jit(step._train_step).lower(step.abstract_state(), tokens).as_text()
    abstract = split_abstract(build_model(cfg))[1]
    specs = jax.tree.leaves(partition_specs(abstract, 1), is_leaf=lambda x: isinstance(x, P))
    layer = {"x".join(map(str, leaf.shape[1:])) + "xf32"
             for leaf, spec in zip(jax.tree.leaves(abstract), specs) if is_stacked(spec)}
    barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
    operands = {t for line in barriers for t in re.findall(r"tensor<([^>]*)>", line.rsplit(":", 1)[-1].split("->")[0])}
    assert barriers and layer and not operands & layer, sorted(operands & layer)


def test_only_the_first_chunks_backward_slots_hold_the_embeddings_gradient():
    """Only virtual stage 0 embeds, so only chunk 0's ring slots pull a gradient back into the word embedding (a
    scatter into the table): a later chunk's pullback has no embedding branch, whose zeros (the whole fp32 table)
    were filled and added to the accumulator in every one of its backward slots."""
    _, step, tokens = _interleaved_step("matmuls")
    state = step.abstract_state()
    table = "f32[%d,%d]" % jax.tree.leaves(state.params["embedding"]["embedding"])[0].shape
    text = jax.jit(step._train_step).lower(state, tokens).compile().as_text()
    scatters = [line for line in text.splitlines() if re.match(rf"\s+%\S*scatter\S* = {re.escape(table)}", line)]
    chunk_of_slot = step.model.pipeline.ring()[0]
    assert 1 in chunk_of_slot and len(scatters) == chunk_of_slot.count(0), (len(scatters), chunk_of_slot)


def test_the_ring_is_allocated_not_filled_on_gpus():
    """The ring's slots are never read before a forward slot writes them, so the step lowered for GPUs allocates
    them (jax.lax.empty: an AllocateBuffer call, no kernel) instead of filling them from one zeros value that XLA
    then copied into every slot's buffers each step (28.5 GiB a step for the 2.5B model with V 3). Lowered, not
    compiled: no GPU needed."""
    if not hasattr(jax.lax, "empty"):
        pytest.skip("this jax has no lax.empty; the ring is zero-filled")
    _, step, tokens = _interleaved_step("matmuls")
    text = jax.jit(step._train_step).trace(step.abstract_state(), tokens).lower(lowering_platforms=("cuda",)).as_text()
    slots = len(step.model.pipeline.ring()[0])
    # Each slot: the stage input and at least one kept residual a layer (2 layers a chunk here).
    assert text.count("@AllocateBuffer") >= slots * 3, text.count("@AllocateBuffer")


def test_a_tick_waits_for_both_shifts_at_once():
    """Both values shifted into a 1F1B tick (the activations and the input gradients) pass one optimization barrier
    at the tick's start, so a tick waits once for its neighbours and XLA cannot start the gradients' shift behind the
    tick's forward (docs/benchmarks.md 4l): the tick loop's body holds a barrier of exactly the two received values."""
    cfg, step, tokens = _interleaved_step("matmuls")
    text = jax.jit(step._train_step).lower(step.abstract_state(), tokens).as_text()
    m = cfg.model
    received = f"tensor<{cfg.training.micro_batch_size}x{m.seq_length}x{m.hidden_size}xf32>"
    barriers = [line.split(" : ", 1)[-1] for line in text.splitlines()
                if re.search(r"stablehlo.optimization_barrier %iterArg\S*, %iterArg\S* :", line)]
    assert [b.strip().split(", ") for b in barriers] == [[received, received]], barriers
