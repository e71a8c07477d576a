"""P's lend, driven by hypothesis: every order of prefills, lend answers (pulled, not pulled,
failed, never), store writes beside the lend, aborts and the clock passing deadlines and fences.

Properties: a request sends its first token at most once, and a lending request has sent it
(200); no block a transfer still touches (unanswered, before its fence) is handed to another
request's prefill; once every answer is in and every fence passed, no request is live and no
block is used. The lend's bytes are the backends' business (tests/test_direct_handoff.py);
this machine plays the ranks itself.
"""
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from rigs import Clock, small_spec

from kvstate import Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate.events import Completion


class LendMachine(RuleBasedStateMachine):
    @initialize(handoff=st.sampled_from(["both", "direct"]), tp=st.integers(1, 2), blocks=st.integers(6, 16),
                prefix_cache=st.booleans())
    def setup(self, handoff, tp, blocks, prefix_cache):
        self.clock = Clock()
        self.policy = Policy(transfer_timeout=5.0, fence_grace=3.0, queue_timeout=8.0)
        self.P = PrefillLifecycle(small_spec(tp), blocks, self.policy, clock=self.clock, handoff=handoff,
                                  lend_timeout=2.0, prefix_cache=prefix_cache)
        self.handoff = handoff
        self.open: dict[int, list] = {}  # command id -> [command, ranks yet to answer]
        self.prefilling: list[str] = []
        self.first: Counter[str] = Counter()
        self.codes: dict[str, int] = {}
        self.n = 0
        self.seen: Counter[str] = Counter()

    # -- the engine's side ---------------------------------------------------------------------
    def _pump(self):
        for c in self.P.poll_commands():
            if C.kind_of(c) in C.TRANSFER_KINDS:
                self.open[c.command_id] = [c, set(c.ranks)]
                self.seen[type(c).__name__] += 1
            elif isinstance(c, C.StartPrefill):
                # its own prefix read given up on may still land (the same bytes: keys are content);
                # another request's transfer must not
                touched = {b for cmd, left in self.open.values()
                           if left and self.clock() < cmd.fence and cmd.request_id != c.request_id
                           for b in cmd.block_ids}
                written = set(c.block_ids[c.num_cached_tokens // self.P.spec.block_size:])  # past shared cached ones
                assert not touched & written, f"{c.request_id} writes blocks another's transfer still touches"
                self.prefilling.append(c.request_id)
            elif isinstance(c, C.SendFirstToken):
                self.first[c.request_id] += 1
                self.codes[c.request_id] = c.error_code

    @rule(length=st.integers(1, 20), shared=st.booleans())
    def admit(self, length, shared):
        toks = [0] * length if shared else [self.n * 31 + i for i in range(length)]
        rid = f"r{self.n}"
        self.n += 1
        try:
            self.P.admit(rid, toks)
        except Exception as e:  # noqa: BLE001 - a prompt larger than the pool is refused, changing nothing
            assert "blocks" in str(e)
        self._pump()

    @precondition(lambda self: self.prefilling)
    @rule(data=st.data())
    def prefill_done(self, data):
        rid = data.draw(st.sampled_from(self.prefilling))
        self.prefilling.remove(rid)
        self.P.prefill_done(rid, 7)
        self._pump()

    @precondition(lambda self: any(left for _, left in self.open.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["whole", "none", "fail"]))
    def answer(self, data, outcome):
        cid = data.draw(st.sampled_from(sorted(k for k, (_, left) in self.open.items() if left)))
        cmd, left = self.open[cid]
        rank = data.draw(st.sampled_from(sorted(left)))
        left.discard(rank)
        n = len(cmd.keys) if outcome == "whole" else 0
        self.seen[f"{type(cmd).__name__}:{outcome}"] += 1
        self.P.complete(Completion(cid, rank, n, error="injected" if outcome == "fail" else None))
        self._pump()

    @precondition(lambda self: self.P.live_requests())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.P.live_requests())))
        self.seen[f"abort:{self.P.state_of(rid)}"] += 1
        self.P.abort(rid)
        self._pump()

    @rule(dt=st.floats(0.1, 4.0))
    def tick(self, dt):
        self.clock.advance(dt)
        self.P.tick()
        self._pump()

    # -- properties ----------------------------------------------------------------------------
    @invariant()
    def first_token_once_and_before_lending(self):
        assert all(v <= 1 for v in self.first.values()), self.first
        for rid in self.P.live_requests():
            if self.P.state_of(rid) == "lending":
                assert self.first[rid] == 1 and self.codes[rid] == 200, rid

    def _answer_all(self, error=None):
        for cid, (_, left) in list(self.open.items()):
            for rank in sorted(left):
                self.P.complete(Completion(cid, rank, 0, error=error))
            left.clear()
        self._pump()

    def teardown(self):
        """Every rank answers at last (late ones too), running prefills finish, the clock
        passes every deadline and fence: nothing is live, and (no prefix cache keeping blocks)
        no block is used."""
        self._answer_all("late")
        for _ in range(8):
            while self.prefilling:
                self.P.prefill_done(self.prefilling.pop(), 7)
                self._pump()
            self._answer_all()
            self.clock.advance(self.policy.transfer_timeout + self.policy.fence_grace + self.policy.queue_timeout)
            self.P.tick()
            self._pump()
        assert self.P.live_requests() == []
        assert self.P.prefix_cache is not None or self.P.pool.num_used == 0


TestLendMachine = LendMachine.TestCase
TestLendMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow], database=None)
