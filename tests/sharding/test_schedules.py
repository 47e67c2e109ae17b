"""Pipeline schedule tables: validity, bubble against the closed forms, memory in flight, buffer plans,
split backwards (zero-bubble), the one-line configuration errors, and the plotting CLI. Pure numpy (the plot
aside): the file runs in ~1 s."""
import numpy as np
import pytest

from sharding import schedules as S
from sharding.schedule_buffers import activation_buffers, gradient_buffers

GRID = ([("gpipe", p, m, 1) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 5, 8)]
        + [("1f1b", p, m, 1) for p in (1, 2, 3, 4, 5) for m in sorted({p, p + 1, 2 * p + 1, 3 * p})]
        + [("interleaved", p, m, v) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p) for v in (2, 3, 4)]
        + [("zb_h1", p, m, 1) for p in (1, 2, 3, 4, 5, 8) for m in sorted({p, p + 1, 2 * p + 1, 3 * p})]
        + [("zb_v", p, m, 2) for p in (1, 2, 3, 4) for m in sorted({p, p + 1, 2 * p + 1, 3 * p, 4 * p})])


def parse(rows: list[str]) -> np.ndarray:
    """Hand-written stage rows ('F0 F1 -- B0', v=1; 'b0 w0' a split backward's B and W) -> table [slots, p, 3]."""
    kinds = {"F": S.FORWARD, "B": S.BACKWARD, "b": S.INPUT_GRAD, "w": S.WEIGHT_GRAD}
    cells = [[(S.IDLE, -1, -1) if a == "--" else (kinds[a[0]], int(a[1:]), 0) for a in row.split()] for row in rows]
    return np.array(cells).transpose(1, 0, 2)


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_every_table_is_valid_and_its_bubble_is_the_closed_form(name, p, m, v):
    schedule = S.build(name, p, m, v)
    S.validate(schedule)
    if name == "zb_h1":  # tight: 3m busy (F, B, W) + p-1 idle slots per stage
        assert schedule.table.shape == (3 * m + p - 1, p, 3)
        assert S.bubble_fraction(schedule) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    elif name == "zb_v":  # 6m busy (F, B, W of two chunks) + p-1 idle slots per stage, its lower bound
        assert schedule.table.shape == (6 * m + p - 1, p, 3)
    else:  # tight: 2vm busy + 2(p-1) idle slots per stage
        assert schedule.table.shape == (2 * (v * m + p - 1), p, 3)
        assert S.bubble_fraction(schedule) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert S.bubble_fraction(schedule) == pytest.approx(S.closed_form_bubble(name, p, m, v), abs=1e-12)
    assert S.max_in_flight(schedule).tolist() == S.closed_form_in_flight(name, p, m, v)


def test_tables_match_hand_worked_timings():
    # Worked by hand in the slot model (unit cost, a message usable one slot after it is sent).
    gpipe = parse(["F0 F1 F2 -- -- B0 B1 B2",
                   "-- F0 F1 F2 B0 B1 B2 --"])
    one_f_one_b = parse(["F0 F1 -- B0 F2 B1 -- B2",
                         "-- F0 B0 F1 B1 F2 B2 --"])
    assert np.array_equal(S.gpipe(2, 3).table, gpipe)
    assert np.array_equal(S.one_f_one_b(2, 3).table, one_f_one_b)


def test_zb_h1_matches_hand_worked_timing():
    # Stage 1 runs W of microbatch j one microbatch after its B (d=1 held back); stage 0's W follows its B.
    # Each stage is idle one slot (p-1), against two in 1F1B's table above, for 3m busy slots instead of 2m.
    zb_h1 = parse(["F0 F1 -- b0 w0 F2 b1 w1 b2 w2",
                   "-- F0 b0 F1 b1 w0 F2 b2 w1 w2"])
    assert np.array_equal(S.zb_h1(2, 3).table, zb_h1)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (4, 32), (8, 16)])
def test_zb_h1_keeps_1f1b_peak_memory_and_buffers_flat_in_microbatches(p, m):
    zb, one = S.zb_h1(p, m), S.one_f_one_b(p, m)
    assert S.max_in_flight(zb).max() == S.max_in_flight(one).max() == p
    assert activation_buffers(zb).size == activation_buffers(one).size == p
    assert gradient_buffers(zb).size == p - 1  # a gradient waits from B to its deferred W (1F1B: 1 entry)
    forward, input_grad, weight_grad = S.action_slots(zb)
    assert (weight_grad > input_grad).all() and (input_grad > forward).all()


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (5, 10), (8, 16), (8, 32)])
def test_zb_v_halves_zb_h1_bubble_at_1f1b_memory(p, m):
    """In time (a zb_v cell is half a stage): zb_v idles under half of ZB-H1's p-1 per stage (exactly (p-1)/2
    for p <= 4, a few half-slots more beyond), holding 2p half-stage inputs: p stages' worth, as 1F1B's stage 0."""
    zb_v, zb_h1 = S.zb_v(p, m), S.zb_h1(p, m)
    idle_v = (zb_v.table[:, :, S.KIND] == S.IDLE).sum(axis=0) / 2
    idle_h1 = (zb_h1.table[:, :, S.KIND] == S.IDLE).sum(axis=0)
    assert (idle_v <= (p - 1) / 2 + 2.5).all() and idle_v.max() < p - 1 <= idle_h1.min()
    assert zb_v.num_slots / 2 < zb_h1.num_slots
    assert S.max_in_flight(zb_v).tolist() == [2 * p] * p
    # the V: device d holds model chunks d and 2p-1-d, so device 0 embeds and computes the loss
    assert zb_v.chunk_map.tolist() == [[d, 2 * p - 1 - d] for d in range(p)]


def test_interleaved_places_chunk_c_of_device_d_as_model_chunk_c_times_p_plus_d():
    schedule = S.interleaved(2, 2, 2)
    forward, backward, weight = S.action_slots(schedule)
    assert (weight == backward).all()  # one cell per backward
    # microbatch 0 walks model chunks 0,1,2,3 on devices 0,1,0,1, one slot apart; its gradient comes back
    assert forward[:, 0].tolist() == [0, 1, 2, 3]
    assert backward[:, 0].tolist() == [8, 7, 5, 4]  # device 1 runs microbatch 1 in slots 5-6 (worked by hand)
    assert [tuple(schedule.table[t, t % 2]) for t in range(4)] == [(1, 0, 0), (1, 0, 0), (1, 0, 1), (1, 0, 1)]


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (4, 16), (8, 9)])
def test_1f1b_keeps_at_most_p_in_flight_while_gpipe_keeps_all(p, m):
    assert S.max_in_flight(S.one_f_one_b(p, m)).tolist() == [p - d for d in range(p)]
    assert S.max_in_flight(S.gpipe(p, m)).tolist() == [m] * p


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3)])
def test_interleaved_holds_p_stages_of_activations_with_less_warmup_than_megatron(p, m, v):
    lean = S.interleaved(p, m, v)
    assert S.max_in_flight(lean).tolist() == [v * p - d for d in range(p)]  # v*p chunks of 1/v on stage 0
    # Megatron-LM's code warms up 2(p-1-d) + (v-1)p: same bubble in the slot model, more inputs alive
    published = S.from_orders("interleaved", p, m, v, S._interleaved_orders(p, m, v, megatron_warmup=True))
    assert S.bubble_fraction(published) == S.bubble_fraction(lean) == pytest.approx((p - 1) / (v * m + p - 1))
    assert S.max_in_flight(published).tolist() == [min(2 * (p - 1 - d) + (v - 1) * p + 1, v * m) for d in range(p)]


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaving_lowers_the_bubble_as_the_closed_form_says(p, m, v):
    plain, inter = S.one_f_one_b(p, m), S.interleaved(p, m, v)
    assert S.bubble_fraction(inter) < S.bubble_fraction(plain)
    # idle slots per stage stay 2(p-1) while busy slots grow v-fold
    def idle(s):
        return (s.table[:, :, S.KIND] == S.IDLE).sum(axis=0).tolist()
    assert idle(inter) == idle(plain) == [2 * (p - 1)] * p


@pytest.mark.parametrize("args, fragment", [
    (("pipedream", 4, 8, 1), "pipeline.schedule='pipedream': unknown schedule"),
    (("1f1b", 4, 3, 1), "pipeline.microbatches=3: the 1f1b schedule needs at least"),
    (("interleaved", 4, 6, 2), "pipeline.microbatches=6: the interleaved schedule needs a multiple"),
    (("interleaved", 4, 8, 1), "pipeline.virtual_stages=1: the interleaved schedule needs at least 2"),
    (("gpipe", 4, 8, 2), "pipeline.virtual_stages=2: only pipeline.schedule='interleaved'"),
    (("1f1b", 4, 8, 2), "pipeline.virtual_stages=2"),
    (("gpipe", 4, 0, 1), "pipeline.microbatches=0"),
    (("gpipe", 0, 4, 1), "mesh.pipeline=0"),
    (("zb_h1", 4, 3, 1), "pipeline.microbatches=3: the zb_h1 schedule needs at least"),
    (("zb_h1", 4, 8, 2), "pipeline.virtual_stages=2: only pipeline.schedule='interleaved'"),
    (("zb_v", 4, 8, 1), "pipeline.virtual_stages=1: the zb_v schedule runs two chunks per stage; set 2"),
    (("zb_v", 4, 3, 2), "pipeline.microbatches=3: the zb_v schedule needs at least"),
])
def test_misconfigurations_raise_one_line_naming_the_key(args, fragment):
    for call in (S.build, S.closed_form_bubble):
        with pytest.raises(S.ScheduleConfigError) as info:
            call(*args)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    assert issubclass(S.ScheduleConfigError, ValueError)


def broken(schedule, edit):
    table = np.array(schedule.table)
    edit(table)
    return S.Schedule(schedule.name, schedule.stages, schedule.microbatches, schedule.virtual_stages, table)


def swap(t1, d1, t2, d2):
    def edit(table):
        table[[t1, t2], [d1, d2]] = table[[t2, t1], [d2, d1]]
    return edit


def put(t, d, cell):
    def edit(table):
        table[t, d] = cell
    return edit


@pytest.mark.parametrize("make, edit, fragment", [
    # stage 1 runs microbatch 0's backward (slot 2) and forward (slot 1) in the wrong order
    (lambda: S.one_f_one_b(2, 3), swap(1, 1, 2, 1), "does not follow its forward"),
    # stage 1's first forward moved into slot 0, before stage 0's output exists
    (lambda: S.gpipe(2, 3), swap(0, 1, 1, 1), "forward of chunk 0 it needs has arrived"),
    # stage 0 runs microbatch 0's backward in the slot where stage 1's is still running
    (lambda: S.one_f_one_b(2, 3), swap(2, 0, 3, 0), "gradient from chunk 1 has arrived"),
    (lambda: S.gpipe(2, 3), put(7, 0, (S.IDLE, -1, -1)), "backward of microbatch 2 chunk 0 is missing"),
    (lambda: S.gpipe(2, 3), put(3, 0, (S.FORWARD, 2, 0)), "forward of microbatch 2 chunk 0 runs twice"),
    (lambda: S.gpipe(2, 3), put(3, 0, (S.FORWARD, 3, 0)), "microbatch < 3"),
    (lambda: S.interleaved(2, 2, 2), put(0, 0, (S.FORWARD, 0, 2)), "chunk < 2"),
    # stage 0 runs microbatch 0's W (slot 4) before its B (slot 3)
    (lambda: S.zb_h1(2, 3), swap(3, 0, 4, 0), "weight gradient of microbatch 0 chunk 0 .* runs before"),
    (lambda: S.zb_h1(2, 3), put(9, 0, (S.IDLE, -1, -1)), r"weight gradient \(W\) of microbatch 2 chunk 0 is missing"),
    (lambda: S.zb_h1(2, 3), put(2, 0, (S.BACKWARD, 0, 0)), "has a whole backward and a split one"),
    # stage 0's B of microbatch 0 moved into slot 2, where stage 1's B that it waits for runs
    (lambda: S.zb_h1(2, 3), swap(2, 0, 3, 0), "gradient from chunk 1 has arrived"),
])
def test_validate_catches_broken_tables(make, edit, fragment):
    with pytest.raises(ValueError, match=fragment):
        S.validate(broken(make(), edit))


def test_schedule_table_is_read_only():
    schedule = S.gpipe(2, 2)
    with pytest.raises(ValueError):
        schedule.table[0, 0, 0] = S.IDLE


def replay(schedule):
    """Run the table with tags instead of tensors, using only the buffer plans, as an executor would.

    Each stage owns two buffers; a tag (model chunk, microbatch) says which value an entry holds. Each slot a
    stage's output goes out on every channel of its kind (NEXT to d+1, PREV to d-1, SELF to itself; round
    the ring unless V-shaped), and a receiver stores what a channel brings where the plan says.
    Every read must find the value its action needs: the input of (k, i), or the gradient for it (a split
    backward's B and W both read both), and every message sent must be stored once.
    """
    p, K, ks = schedule.stages, schedule.num_chunks, schedule.chunk_map
    acts, grads = activation_buffers(schedule), gradient_buffers(schedule)
    buffers = {"act": [[None] * acts.size for _ in range(p)], "grad": [[None] * grads.size for _ in range(p)]}
    stored = 0
    for t in range(schedule.num_slots):
        sent = {"act": [None] * p, "grad": [None] * p}
        for d in range(p):
            kind, i, c = schedule.table[t, d]
            k = ks[d, c]
            if kind == S.IDLE:
                assert acts.read[t, d] == grads.read[t, d] == -1
                continue
            if k > 0:
                assert buffers["act"][d][acts.read[t, d]] == ("in", k, i)
            else:
                assert acts.read[t, d] == -1  # chunk 0 reads the batch
            if kind == S.FORWARD:
                assert grads.read[t, d] == -1
                sent["act"][d] = ("in", k + 1, i) if k < K - 1 else None
                continue
            if k < K - 1:
                assert buffers["grad"][d][grads.read[t, d]] == ("grad", k, i)
            else:
                assert grads.read[t, d] == -1  # the last chunk starts from its loss
            if k > 0 and kind in S.GIVES_INPUT_GRAD:  # W reads the gradient again, sends nothing
                sent["grad"][d] = ("grad", k - 1, i)
        stored += _deliver(schedule, {"act": acts, "grad": grads}, buffers, sent, t)
        expected = sum(m is not None for ms in sent.values() for m in ms)
        assert stored == expected, (t, stored, expected)
        stored = 0


def _deliver(schedule, plans, buffers, sent, t):
    """Messages land at the end of the slot, after this slot's reads; returns how many were stored."""
    p, ring = schedule.stages, not schedule.v_shape
    device_of = {int(k): d for (d, c), k in np.ndenumerate(schedule.chunk_map)}
    stored = 0
    for name, plan in plans.items():
        for channel, write in plan.writes.items():
            for d in range(p):
                src = {"next": d - 1, "prev": d + 1, "self": d}[channel]
                src = src % p if ring else src
                if write[t, d] < 0:
                    continue
                message = sent[name][src] if 0 <= src < p else None
                assert message is not None and device_of[int(message[1])] == d, (channel, t, d, message)
                buffers[name][d][write[t, d]] = message
                stored += 1
    return stored


def peak_alive(plan):
    """Most messages any stage holds at once, counted directly from the lifetimes."""
    slots = np.arange(plan.read.shape[0])[:, None, None, None]
    alive = (plan.arrive >= 0) & (plan.arrive <= slots) & (slots <= plan.release)
    return int(alive.sum(axis=(2, 3)).max())


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_buffer_plans_deliver_every_value_and_are_as_small_as_possible(name, p, m, v):
    schedule = S.build(name, p, m, v)
    replay(schedule)
    for plan in (activation_buffers(schedule), gradient_buffers(schedule)):
        assert plan.size == peak_alive(plan)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (4, 32)])
def test_1f1b_buffers_do_not_grow_with_microbatches(p, m):
    schedule = S.one_f_one_b(p, m)
    assert activation_buffers(schedule).size == p and gradient_buffers(schedule).size == 1
    assert activation_buffers(S.gpipe(p, m)).size == m


def test_plot_cli_writes_png(tmp_path):
    from experiments import plot_schedule
    one, every = tmp_path / "one.png", tmp_path / "all.png"
    plot_schedule.main(["--schedule=interleaved", "--stages=2", "--microbatches=4", "--virtual_stages=2",
                        f"--out={one}"])
    plot_schedule.main(["--all", "--stages=2", "--microbatches=2", f"--out={every}"])
    for png in (one, every):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_from_orders_reports_orders_that_wait_on_each_other():
    # stage 0 wants microbatch 0's gradient before it has sent the activation that would produce it
    orders = [[(S.BACKWARD, 0, 0), (S.FORWARD, 0, 0)], [(S.FORWARD, 0, 0), (S.BACKWARD, 0, 0)]]
    with pytest.raises(ValueError, match="deadlock at slot 0"):
        S.from_orders("mine", 2, 1, 1, orders)
