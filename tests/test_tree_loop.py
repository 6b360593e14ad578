"""The tree policies' host loop (`TreeLoop`): root steps that hold are dispatched one step ahead,
the gate records every step exactly once, and nothing is dispatched ahead past the budget."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax import tree_loop
from bastion_jax.controller import Controller, Policy
from bastion_jax.draft_gate import DraftGate
from bastion_jax.tree_decoding import DRAFT, FLUSH, HOLD
from bastion_jax.tree_loop import TreeLoop

BUCKETS = (1, 4, 8)


class Latency:
    """AR 1.0; drafting costs 0.6 more; verify 0.01 per node; no online correction."""

    def predict(self, b, c):
        return {"ar": 1.0, "ar+draft": 1.6}.get(b) or 1.6 + 0.01 * b

    def step_time(self, b, c, draft):
        return (1.6 if draft else 1.0) if b == 0 else self.predict(b, c) - (0.0 if draft else 0.6)

    def observe(self, *a):
        pass


def make_loop(log, batch=2):
    """A TreeLoop over fake compiled steps that log their dispatches; a drafter the gate already
    knows to be useless (realised acceptance rho = 0), so it holds, with a probe now and then."""
    gate = DraftGate(BUCKETS, Latency().step_time, pending_slots=64, block_size=4)
    gate.rho, gate.a_bar = 0.0, np.array([0.5, 1.0, 1.2])

    def root(then):
        def step(tp, dp, state, active, key):
            log.append(("dispatch", then))
            out = types.SimpleNamespace(tokens=np.full((batch, 1), len(log)), count=np.ones(batch, np.int32))
            return state, out, np.zeros((batch, len(BUCKETS)))

        return step

    def tree(tp, dp, state, active, key):
        log.append(("dispatch", "tree"))
        out = types.SimpleNamespace(tokens=np.zeros((batch, 2)), count=np.full(batch, 2, np.int32))
        return state, out, np.zeros((batch, len(BUCKETS)))

    controller = Controller(Policy("bastion"), BUCKETS, Latency())
    roots = {t: root(t) for t in (HOLD, DRAFT, FLUSH)}
    loop = TreeLoop("bastion", controller, gate, {b: tree for b in BUCKETS}, roots, Latency(), BUCKETS,
                    None, None, np.zeros((batch, len(BUCKETS))))
    return loop, gate


def run(loop, n, log, monkeypatch, look_ahead=lambda i: True, tree_ahead=lambda i: False, batch=2):
    """n steps, each given its own key (the step index) when the loop asks for one; reads are logged."""
    real_read = tree_loop.read
    monkeypatch.setattr(tree_loop, "read", lambda *a: (log.append(("read",)), real_read(*a))[1])
    keys = iter(range(1000))
    active = np.ones(batch, bool)
    for i in range(n):
        loop.step(None, active, active, np.full(batch, 10 + i), lambda: next(keys), look_ahead(i), tree_ahead(i))


def test_held_root_steps_are_dispatched_one_ahead(monkeypatch):
    log = []
    loop, gate = make_loop(log)
    run(loop, 12, log, monkeypatch)
    kinds = [e[0] for e in log]
    # The first step is dispatched and, since it holds, the next one before the first read; from
    # then on each read is preceded by the next dispatch.
    assert kinds[:3] == ["dispatch", "dispatch", "read"]
    reads = [i for i, k in enumerate(kinds) if k == "read"]
    assert len(reads) == 12
    lead = [sum(k == "dispatch" for k in kinds[:r]) - j for j, r in enumerate(reads)]
    # A read after a drafting root step (a probe) has no step ahead of it; every held one has one.
    thens = [e[1] for e in log if e[0] == "dispatch"]
    assert HOLD in thens and DRAFT in thens  # a probe came along
    assert max(lead) == 2 and lead.count(2) >= 8
    # Every step the host consumed was recorded by the gate exactly once.
    consumed = len(reads)
    assert gate.held + gate.drafted + sum(t == FLUSH for t in thens[:consumed]) == consumed
    assert loop.controller.histogram[0] == consumed


def test_nothing_is_dispatched_ahead_at_the_budget(monkeypatch):
    log = []
    loop, gate = make_loop(log)
    run(loop, 3, log, monkeypatch, look_ahead=lambda i: False)
    assert [e[0] for e in log] == ["dispatch", "read"] * 3
    assert gate.held == 3 and loop.queued is None


def make_fixed_loop(log, kind="fixed", batch=2):
    """A TreeLoop of policy `kind` whose every step is the bucket-4 tree step (fake, logging)."""

    def tree(tp, dp, state, active, key):
        log.append(("dispatch", key))
        out = types.SimpleNamespace(tokens=np.zeros((batch, 2)), count=np.full(batch, 2, np.int32))
        return state, out, np.zeros((batch, len(BUCKETS)))

    policy = Policy.parse("fixed:4") if kind == "fixed" else Policy("bastion")

    class Pinned(Controller):  # bastion's loop, its choice pinned to 4 (no gate: every step a tree step)
        def choose(self, *a, **k):
            return 4

    controller = (Controller if kind == "fixed" else Pinned)(policy, BUCKETS, Latency())
    return TreeLoop(kind, controller, None, {b: tree for b in BUCKETS}, None, Latency(), BUCKETS, None, None,
                    np.zeros((batch, len(BUCKETS))))


def test_fixed_tree_steps_are_dispatched_one_ahead(monkeypatch):
    """fixed:N: the next tree step goes out before this one is read, while every row has room for
    it; each step still gets its own key, in order; at the end of the budget nothing goes ahead."""
    log = []
    loop = make_fixed_loop(log)
    run(loop, 6, log, monkeypatch, tree_ahead=lambda i: i < 4)
    # Steps 0-3 dispatch the next one before their read; step 4 (dispatched by step 3) reads
    # alone, and step 5 is dispatched and read in turn.
    assert log == [("dispatch", 0), ("dispatch", 1), ("read",), ("dispatch", 2), ("read",), ("dispatch", 3),
                   ("read",), ("dispatch", 4), ("read",), ("read",), ("dispatch", 5), ("read",)]
    assert loop.queued is None and loop.controller.histogram[4] == 6


def test_bastion_tree_steps_go_out_right_after_the_read(monkeypatch):
    """bastion chooses each bucket on the curve the read brings, so its next tree step goes out after
    that read (never before it) but before the call returns (while the host emits), at the bucket that
    curve asks for; nothing goes out past the budget (tree_ahead False) or after a step that committed
    a stop id (a stop id the step did not commit does not count)."""
    log, batch, stop = [], 2, 7
    # Curves per step (the controller, AR-free: (A(b) + 1) / (1.6 + 0.01 b)): [0, 3, 3] -> 4,
    # [0, 1, 5] -> 8; tokens: step 0 has the stop id past its count, step 2 commits it in row 1.
    curves = iter([[0, 1, 5], [0, 3, 3], [0, 1, 5], [0, 3, 3], [0, 1, 5]])
    tokens = iter([[[1, 1, stop]] * 2, [[1, 1, 1]] * 2, [[1, 1, 1], [1, stop, 1]], [[1, 1, 1]] * 2,
                   [[1, 1, 1]] * 2])

    def tree(b):
        def step(tp, dp, state, active, key):
            log.append(("dispatch", b))
            out = types.SimpleNamespace(tokens=np.array(next(tokens)), count=jnp.full(batch, 2, jnp.int32))
            return state, out, np.tile(next(curves), (batch, 1)).astype(float)

        return step

    controller = Controller(Policy("bastion"), BUCKETS, Latency())
    loop = TreeLoop("bastion", controller, None, {b: tree(b) for b in BUCKETS}, None, Latency(), BUCKETS, None,
                    None, np.tile([0.0, 3.0, 3.0], (batch, 1)), stop_ids=[stop])
    real_read = tree_loop.read
    monkeypatch.setattr(tree_loop, "read", lambda *a: (log.append(("read",)), real_read(*a))[1])
    active = np.ones(batch, bool)
    for i, ahead in enumerate([True, True, True, True, False]):
        loop.step(None, active, active, np.full(batch, 10 + 2 * i), lambda: None, True, ahead)
        log.append(("return",))
    assert log == [("dispatch", 4), ("read",), ("dispatch", 8), ("return",),  # chosen on step 0's curve
                   ("read",), ("dispatch", 4), ("return",),
                   ("read",), ("return",),  # step 2 committed a stop id: its row ends, nothing goes out
                   ("dispatch", 8), ("read",), ("dispatch", 4), ("return",),
                   ("read",), ("return",)]  # no room for a step more
    assert loop.queued is None and controller.histogram[4] == 3 and controller.histogram[8] == 2


def test_a_step_sent_after_the_read_is_timed_only_if_the_host_is_back_first(monkeypatch):
    """A step sent right after its predecessor's read ran while the host emitted: read on the host's
    return, it is timed from its dispatch, which prices the host's absence as the bucket's time when
    the step had already ended. Such a step (ready on the host's return) is not observed; one still
    running is."""
    batch, ready = 2, iter([True, False, True, False])
    observed = []

    class Count(np.ndarray):
        def is_ready(self):
            return next(ready)

    class Timed(Latency):
        def observe(self, b, c, t):
            observed.append(b)

    def tree(b):
        def step(tp, dp, state, active, key):
            out = types.SimpleNamespace(tokens=np.ones((batch, 2)), count=np.full(batch, 2, np.int32).view(Count))
            return state, out, np.tile([0.0, 1.0, 5.0], (batch, 1))  # always bucket 8

        return step

    latency = Timed()
    loop = TreeLoop("bastion", Controller(Policy("bastion"), BUCKETS, latency), None, {b: tree(b) for b in BUCKETS},
                    None, latency, BUCKETS, None, None, np.tile([0.0, 1.0, 5.0], (batch, 1)))
    active = np.ones(batch, bool)
    for i in range(5):
        loop.step(None, active, active, np.full(batch, 10 + 2 * i), lambda: None, True, True)
    # Step 0 was sent and read in one call (timed); steps 1-4 were sent after a read: 1 and 3 were
    # ready on the host's return, 2 and 4 were not.
    assert observed == [8, 8, 8]


@pytest.mark.parametrize("gain, margin, drafts", [(1.05, 0.1, False), (1.05, 0.0, True), (1.2, 0.1, True),
                                                   (0.95, 0.0, False)])
def test_gate_drafts_only_past_its_margin(gain, margin, drafts):
    """R_d = gain x R_0 (AR step 1.0, a drafting bucket-4 step 2.0, rho A_bar(4) = 2 gain - 1): the
    gate drafts iff R_d > (1 + margin) R_0, whether it holds a tree (use_tree) or not (root_then)."""
    step_time = lambda b, c, draft: 1.0 if b == 0 else 2.0  # noqa: E731
    gate = DraftGate((4,), step_time, pending_slots=64, block_size=4, margin=margin)
    gate.rho, gate.a_bar = 1.0, np.array([2 * gain - 1])
    gate.probe = 100  # no probe due
    assert gate.use_tree(10) is drafts
    assert (gate.root_then(10) == DRAFT) is drafts


def test_a_probes_tree_is_judged_on_its_own_curve_with_rho_at_least_one():
    """A gate that learnt drafts do badly (rho = 0) still verifies a probe's tree whose own curve pays
    at rho 1, so rho can learn they now do well; a probe's tree that does not pay even so is dropped
    (a root step instead), and a tree outside a probe is verified only if drafting pays."""
    step_time = lambda b, c, draft: 1.0 if b == 0 else 1.6  # noqa: E731
    gate = DraftGate((4,), step_time, pending_slots=64, block_size=4)
    gate.rho, gate.a_bar = 0.0, np.array([3.0])

    def probe() -> list[int]:
        thens = []
        while not thens or thens[-1] != DRAFT:
            thens.append(gate.root_then(10))
            gate.record(thens[-1], 1)
        return thens

    assert probe() == [HOLD, HOLD, HOLD, DRAFT]  # the 4th AR step probes
    assert not gate.use_tree(10, np.array([0.5]))  # (1 x 0.5 + 1) / 1.6 < 1: even at rho 1 it does not pay
    assert probe() == [HOLD] * 7 + [DRAFT]  # the interval doubled
    assert gate.use_tree(10, np.array([3.0]))  # (1 x 3 + 1) / 1.6 > 1: verified although rho = 0
    assert not gate.use_tree(10, np.array([3.0]))  # the same tree outside a probe: (0 x 3 + 1) / 1.6 < 1
    gate.observe_verify(4, 3.0, 2.4)  # it did well: rho 0 -> 0.3 / 1.25 = 0.24 (the first of 8 + 1)
    assert gate.rho == pytest.approx(0.24) and gate.use_tree(10)  # (0.24 * 3 + 1) / 1.6 > 1


def test_a_strong_tree_or_lookup_hint_makes_the_gate_draft():
    """A_bar says drafting does not pay (rho A_bar(4) = 0.5: R_d = 0.75 R_0), but the tree in hand, or
    after a held step the lookup chain's curve, promises 2.0 accepted drafts (R_d = 1.5 R_0): that
    decision drafts; the next one, without them, holds again (A_bar itself is not moved by a hint)."""
    step_time = lambda b, c, draft: 1.0 if b == 0 else 2.0  # noqa: E731
    gate = DraftGate((4,), step_time, pending_slots=64, block_size=4)
    gate.rho, gate.a_bar = 1.0, np.array([0.5])
    gate.probe = 100  # no probe due
    strong = np.array([2.0])
    assert not gate.use_tree(10) and gate.use_tree(10, strong)
    assert gate.root_then(10) == HOLD
    assert gate.root_then(10, strong) == DRAFT
    assert gate.root_then(10, np.array([0.2])) == HOLD and gate.a_bar[0] == 0.5


@pytest.mark.parametrize("draft_price, drafts", [(0.1, True), (0.27, True), (0.3, False)])
def test_the_gate_drafts_for_the_option_of_a_rare_good_tree(draft_price, drafts):
    """One recent tree in eight promised 3 accepted drafts, the rest none. A_bar (0.25) does not pay
    ((0.25 + 1) / 2 < 1 AR step), but a draft buys the option to verify only the good tree, which gains
    (3 + 1 - 2) - (1 - (1 + price)) AR steps over a root step that drafts: (2 + price) / 8 per draft
    against the draft's price. It pays at price 0.1 and 0.27 (0.284 > 0.27; without the root step's
    own draft in the comparison it would not: 0.25), not at 0.3 (0.2875 < 0.3)."""
    step_time = lambda b, c, draft: (1.0 + draft_price * draft) if b == 0 else 2.0  # noqa: E731
    gate = DraftGate((4,), step_time, pending_slots=64, block_size=4)
    gate.probe = 100  # no probe due
    for a in [3.0] + [0.0] * 7:
        gate.observe_tree(np.array([a]))
    assert not gate.pays(10)  # the mean-curve rule alone holds
    assert gate.option_pays(10) is drafts
    assert (gate.root_then(10) == DRAFT) is drafts
    gate.rho = 0.0  # a drafter whose promises never come true: no option is worth a draft
    assert not gate.option_pays(10)
    window = DraftGate((4,), step_time, pending_slots=64, block_size=4, window=4)
    for a in [3.0] + [0.0] * 7:
        window.observe_tree(np.array([a]))
    assert len(window.recent) == 4 and not window.option_pays(10)  # the good tree fell out of the window


def test_the_gates_memory_round_trips():
    """`memory` then `restore` hands a later request's gate everything the earlier one learnt."""
    step_time = lambda b, c, draft: 1.0 if b == 0 else 2.0  # noqa: E731
    old = DraftGate((4, 8), step_time, pending_slots=64, block_size=8)
    for a in ([1.0, 2.0], [0.5, 0.7]):
        old.observe_tree(np.array(a))
    old.observe_verify(8, 2.0, 1.0)
    old.observe_chain(4, 1.5, 0.5)
    old.probe = 16
    new = DraftGate((4, 8), step_time, pending_slots=64, block_size=8)
    new.restore(old.memory())
    assert new.rho == old.rho and new.verified == 1 and new.probe == 16
    assert np.array_equal(new.a_bar, old.a_bar) and len(new.recent) == 2
    assert new.chain_rho(4) == old.chain_rho(4) != 1.0
    short = DraftGate((4, 8), step_time, pending_slots=64, block_size=8, window=1)
    short.restore(old.memory())  # a gate with a shorter window keeps only the latest curves
    assert len(short.recent) == 1 and np.array_equal(short.recent[0], [0.5, 0.7])


def test_held_lookup_chains_are_verified_without_drafting(monkeypatch):
    """After root steps that hold, a lookup chain worth verifying (the curve a held step returns) is
    verified by a tree step that holds too (`chains`), chosen on the chain just read: no root step
    is dispatched ahead of that read, no chain step ahead of its own; its committed rows stay inside
    the feature buffer (then a flush); rho (the drafter's calibration) is untouched."""
    log, batch, slots = [], 2, 16
    gate = DraftGate(BUCKETS, Latency().step_time, pending_slots=slots, block_size=8, held_rows=8)
    gate.rho, gate.a_bar = 0.0, np.array([0.5, 1.0, 1.2])
    paying = np.array([0.0, 1.5, 2.0])  # a long match: c(4) = 1.5, c(8) = 2.0
    hints = iter([np.zeros(3)] * 6 + [paying] * 100)  # the curve each held root step returns, in order
    dev = {"pending": 0}  # the device's feature buffer fill

    def fill(count, then):
        assert dev["pending"] + count <= slots  # every step writes its rows first: never overflows
        dev["pending"] = dev["pending"] + count if then == HOLD else 0

    def root(then):
        def step(tp, dp, state, active, key):
            fill(1, then)
            log.append(("dispatch", then))
            out = types.SimpleNamespace(tokens=np.zeros((batch, 1)), count=np.ones(batch, np.int32))
            return state, out, np.tile(next(hints) if then != DRAFT else np.zeros(3), (batch, 1))

        return step

    def chain(b):
        def step(tp, dp, state, active, key):
            fill(3, HOLD)
            log.append(("dispatch", "chain", b))
            out = types.SimpleNamespace(tokens=np.zeros((batch, 3)), count=np.full(batch, 3, np.int32))
            return state, out, np.tile(paying, (batch, 1))

        return step

    def tree(tp, dp, state, active, key):
        fill(2, DRAFT)
        log.append(("dispatch", "tree"))
        out = types.SimpleNamespace(tokens=np.zeros((batch, 2)), count=np.full(batch, 2, np.int32))
        return state, out, np.zeros((batch, len(BUCKETS)))

    controller = Controller(Policy("bastion"), BUCKETS, Latency())
    loop = TreeLoop("bastion", controller, gate, {b: tree for b in BUCKETS}, {t: root(t) for t in (HOLD, DRAFT, FLUSH)},
                    Latency(), BUCKETS, None, None, np.zeros((batch, len(BUCKETS))), {4: chain(4), 8: chain(8)})
    run(loop, 30, log, monkeypatch)
    dispatches = [e for e in log if e[0] == "dispatch"]
    chains = [i for i, e in enumerate(log) if e[:2] == ("dispatch", "chain")]
    assert len(chains) >= 5 and all(log[i + 1] == ("read",) for i in chains)  # nothing goes out before a chain's read
    assert {log[i][2] for i in chains} <= {4, 8} and any(log[i][2] == 8 for i in chains)
    first = chains[0]
    # The first paying chain came back with the 6th held root step's read; the root step dispatched
    # ahead of that read is not followed by another before its own read, and the chain step comes next.
    assert log[first - 1] == ("read",) and log[first - 2] == ("read",)
    assert ("dispatch", FLUSH) in dispatches[dispatches.index(log[first]):]  # the buffer filled: a flush
    # A probe that came due on a held chain verifies the chain and then drafts: the drafting tree step.
    drafting_chains = [e for e in dispatches if e == ("dispatch", "tree")]
    assert gate.chained == len(chains) + len(drafting_chains) and gate.rho == 0.0


def test_chain_bucket_keeps_the_feature_buffer_and_prices():
    """The gate verifies a held chain only where it pays against a root step with the same `then`,
    never with FLUSH, and only with a bucket whose rows still fit in the feature buffer."""
    gate = DraftGate(BUCKETS, Latency().step_time, pending_slots=16, block_size=8)
    paying = np.array([0.0, 1.5, 2.0])
    assert gate.chain_bucket(10, paying, HOLD) == 8  # (1 + 2.0) / 1.08 beats (1 + 1.5) / 1.04
    assert gate.chain_bucket(10, np.array([0.0, 0.02, 0.03]), HOLD) == 0  # a tie with a root step: no
    assert gate.chain_bucket(10, None, HOLD) == 0 and gate.chain_bucket(10, paying, FLUSH) == 0
    gate.pending = 10
    assert gate.chain_bucket(10, paying, HOLD) == 4  # 10 + 8 rows would not fit in 16
    gate.pending = 13
    assert gate.chain_bucket(10, paying, HOLD) == 0
    assert gate.chain_bucket(10, paying, DRAFT) == 0  # (the rows are buffered before the draft injects them)


def test_chain_rho_learns_each_buckets_bias_and_moves_the_choice():
    """Held chains verified at a bucket whose curve over-promises (8 nodes promised 2.0 accepted tokens,
    gave 0.5) lower that bucket's rho_c until the gate prefers the bucket whose chains keep their
    promise (4 nodes: 1.5 promised, 1.5 given); the other bucket's estimate is untouched, and a
    calibrated bucket stays near 1."""
    gate = DraftGate(BUCKETS, Latency().step_time, pending_slots=16, block_size=8)
    paying = np.array([0.0, 1.5, 2.0])
    assert gate.chain_rho(8) == 1.0 and gate.chain_bucket(10, paying, HOLD) == 8
    for _ in range(6):
        gate.observe_chain(8, 2.0, 0.5)
        gate.observe_chain(4, 1.5, 1.5)
    assert gate.chain_rho(8) < 0.75 and gate.chain_rho(4) == pytest.approx(1.0)
    assert gate.chain_bucket(10, paying, HOLD) == 4
    for _ in range(60):
        gate.observe_chain(4, 1.5, 0.0)
        gate.observe_chain(8, 2.0, 0.0)
    assert gate.chain_rho(4) < 0.1 and gate.chain_bucket(10, paying, HOLD) == 0  # nothing pays now


def test_rho_reads_a_calibrated_drafter_as_calibrated():
    """Trees whose surrogate is exactly the expected acceptance (each of 4 drafts accepted in turn
    with probability 0.4, a chain: accepted drafts = how many accepted before the first miss) leave
    rho near 1: rho is a ratio of sums. A mean of per-tree ratios (0 for the 60% of trees whose first
    draft misses) is biased low, and with it the gate drafted too little."""
    rng = np.random.default_rng(0)
    p = 0.4
    surrogate = sum(p ** d for d in range(1, 5))  # E[accepted] of the chain: 0.6496
    gate = DraftGate((4,), lambda b, c, draft: 1.0, pending_slots=64, block_size=4)
    ratios, rhos = [], []
    for _ in range(4000):
        accepted = 0
        while accepted < 4 and rng.random() < p:
            accepted += 1
        gate.observe_verify(4, surrogate, accepted)
        ratios.append(min(accepted / surrogate, 2.0))
        rhos.append(gate.rho)
    assert gate.verified == 4000
    assert abs(np.mean(rhos[100:]) - 1.0) < 0.05  # (each value spreads ~20%: a window of ~40 trees)
    assert np.mean(ratios) < 0.8  # what the clipped mean of ratios reads instead


def test_rho_finds_out_a_confident_useless_drafter_in_a_few_verifies():
    """A drafter whose surrogate (7 drafts) is never realised: rho falls below 0.1 within about 10
    verified trees (the prior counts as 8), not the ~17 an EMA at rate 0.05 from the start would take."""
    gate = DraftGate((4,), lambda b, c, draft: 1.0, pending_slots=64, block_size=4)
    n = 0
    while gate.rho >= 0.1:
        gate.observe_verify(4, 7.0, 0.0)
        n += 1
    assert n <= 11


def test_bastion_prices_bucket_one_by_its_drafting_root_steps(monkeypatch):
    """bastion runs bucket 1 as a root step that drafts (never a one-node tree step), so every timed
    drafting root step moves bucket 1's price too: otherwise a machine slower (here: faster) than at
    calibration would leave bucket 1 priced apart from the step it is, and the gate would draft every
    step (or never)."""
    from bastion_jax.latency import AR_DRAFT, DevicePeaks, LatencyModel, ModelDims

    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96)
    lat = LatencyModel(dims, DevicePeaks("test", 1e6, 1e6), BUCKETS, drafter=dims, block_size=4)
    before = lat.predict(1, 20)  # seconds: the fake steps take microseconds
    log = []
    loop, _ = make_loop(log)
    loop.latency = lat
    run(loop, 12, log, monkeypatch)
    assert ("dispatch", DRAFT) in log  # the gate probed: a drafting root step was timed
    assert lat.predict(1, 20) < before
    assert lat.predict(1, 20) == lat.predict(AR_DRAFT, 20)


def test_a_batch_is_judged_by_the_rows_that_may_end_it(monkeypatch):
    """The gate and the controller judge a batch's tree by the rows that may be last after the step
    (`controller.last_rows`, from the `remaining` tokens the engine passes, with this step's tokens
    counted for the next one), while rho learns the drafter's calibration from the rows' means."""
    batch = 3
    seen = {}

    class Gate(DraftGate):
        def use_tree(self, context, curve=None):
            seen.setdefault("use_tree", []).append(np.asarray(curve).copy())
            return True

        def observe_verify(self, bucket, surrogate, accepted):
            seen["verify"] = (bucket, surrogate, accepted)

        def observe_tree(self, curve):
            seen["tree"] = np.asarray(curve).copy()

    gate = Gate(BUCKETS, Latency().step_time, pending_slots=64, block_size=4)
    first = np.array([[0.0, 2.5, 3.0], [0.0, 0.5, 1.0], [0.0, 0.2, 0.4]])
    after = np.array([[0.0, 1.0, 1.5], [0.0, 2.0, 2.5], [0.0, 0.1, 0.1]])
    chosen = []

    def tree(tp, dp, state, active, key):
        out = types.SimpleNamespace(tokens=np.zeros((batch, 4)), count=np.array([4, 1, 1], np.int32))
        return state, out, after

    class Recording(Controller):
        def choose(self, curve, context, active, *a, **k):
            chosen.append(np.asarray(active).copy())
            return 4

    loop = TreeLoop("bastion", Recording(Policy("bastion"), BUCKETS, Latency()), gate, {b: tree for b in BUCKETS},
                    {}, Latency(), BUCKETS, None, None, first, block_size=4)
    active = np.ones(batch, bool)
    # Row 2 is a whole block (4) ahead: it cannot be last after the step, so it does not count.
    loop.step(None, active, active, np.full(batch, 10), lambda: None, True, False, np.array([30, 30, 26]))
    np.testing.assert_allclose(seen["use_tree"][0], [0.0, 0.5, 1.0])  # the worse of rows 0 and 1
    assert chosen[-1].tolist() == [True, True, False]
    assert seen["verify"] == (4, pytest.approx((2.5 + 0.5 + 0.2) / 3), pytest.approx(1.0))  # rows' means
    # Then 26 / 29 / 25 tokens left: row 1 is the last; row 0 (3 ahead) and row 2 (4 ahead) ...
    np.testing.assert_allclose(seen["tree"], [0.0, 1.0, 1.5])  # ... row 0 may still be last, row 2 not
    loop.step(None, active, active, np.full(batch, 12), lambda: None, True, False, np.array([26, 29, 25]))
    assert chosen[-1].tolist() == [True, True, False]
    # The engine's count decides (a row cut short at its stop id is inactive): row 1 alone.
    loop.step(None, np.array([False, True, True]), active, np.full(batch, 14), lambda: None, True, False,
              np.array([22, 28, 24]))
    assert chosen[-1].tolist() == [False, True, False]
