"""What one trace of ``overlap(fun)`` accumulates, shared by the interpreter
and the rewriters: the report lines, the shard_maps seen, the fused ops'
settings, the jit-level matmuls made, and which jaxprs can hold a rewrite
at all."""

from __future__ import annotations

from .._abi import SCHEDULES
from .._decide import Policy
from .jaxpr import CANDIDATES, DOT, OTHER_COLLECTIVES, subjaxprs


class State:
    def __init__(self, schedule: str = "auto", policy: Policy = Policy(strict=False)):
        self.lines: list[str] = []
        self.shard_maps = 0
        # The schedule asked of every fused op the rewrite makes ("auto": the
        # cost model's pick, which may be to run the collective and the dot
        # unfused), and the policy their decisions are made under: never
        # strict (a candidate an op refuses stays as written, with the
        # reason), its owner the `overlap` whose report hears of the
        # partitioned products (its backward ones included, made later by
        # JAX's transpose).
        self.schedule = schedule
        self.policy = policy._replace(asked=SCHEDULES[schedule], strict=False)
        # The decisions (`_op.OpDecision`) of the fused ops the rewrite made, in order.
        self.decisions: list = []
        # The commfuse.matmul calls made outside shard_map bodies (their
        # partitioning is reported once the program is compiled).
        self.matmul_sites: set = set()
        self.jit_dots = 0  # dot_generals seen outside shard_map bodies (fused or kept)
        # The mesh axes each value of the shard_map bodies may vary over (`variance.fill`).
        self.axes: dict = {}
        # The policies of the checkpoints being interpreted, outermost first
        # (a value one saves by name keeps its name: `Rewriter._saved_name`).
        self.policies: list = []
        self._memo: dict = {}

    def mark(self) -> tuple:
        """Where the report stands now (`undo` goes back to it)."""
        return len(self.lines), len(self.decisions)

    def undo(self, mark: tuple) -> None:
        """Forgets the lines and decisions since `mark`: what a body left as
        written (a rewrite that failed) did not make."""
        del self.lines[mark[0]:]
        del self.decisions[mark[1]:]

    def needs_work(self, jaxpr, manual: bool) -> bool:
        """Whether interpreting ``jaxpr`` (rather than binding it unchanged) can
        rewrite or report anything: it holds a shard_map, or, inside one
        (``manual``), a collective."""
        key = (id(jaxpr), manual)
        if key not in self._memo:
            self._memo[key] = (jaxpr, False)  # keeps jaxpr alive so its id stays unique
            found = False
            for eqn in jaxpr.eqns:
                name = eqn.primitive.name
                if name == "shard_map" or (manual and (name in CANDIDATES or name in OTHER_COLLECTIVES)) \
                        or (not manual and name == DOT):
                    found = True
                    break
                if any(self.needs_work(sub, manual) for sub in subjaxprs(eqn.params)):
                    found = True
                    break
            self._memo[key] = (jaxpr, found)
        return self._memo[key][1]
