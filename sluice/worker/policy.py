"""Which priority the next message comes from.

Smooth weighted round-robin over the priorities that have work, in inputs:
with weights high=6, normal=3, low=1 and all three busy, out of every 10 inputs
the model runs 6 are high, 3 normal and 1 low, interleaved. A message of n
inputs costs n turns, so tasks of many inputs get no larger share than tasks
of one (counted in messages, 32-input normal and low tasks took as many inputs
as 1-input high ones). `high` is preferred but `low` is never starved; an idle
priority's share goes to the others.
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.contract import Priority


class WeightedPriorityPolicy:
    def __init__(self, weights: dict[Priority, int]):
        if any(w < 1 for w in weights.values()):
            raise ValueError("every priority needs a weight of at least 1")
        self.weights = dict(weights)
        self._current = {p: 0 for p in weights}

    def pick(self, ready: list[Priority], cost: Callable[[Priority], int] = lambda p: 1) -> Priority:
        """The priority whose turn it is; `cost(p)`: the turns p's next message
        takes (its inputs), charged to the one chosen."""
        if not ready:
            raise ValueError("no priority has work")
        # The round's winner: the most credit once each has gained its weight.
        # Ties go to the higher priority (Priority is declared high -> low).
        chosen = max(ready, key=lambda p: (self._current[p] + self.weights[p], -list(Priority).index(p)))
        self._charge(chosen, ready, max(1, cost(chosen)))
        return chosen

    def refund(self, chosen: Priority, ready: list[Priority], turns: int = 1) -> None:
        """Undo the pick(ready) that chose `chosen` at `turns`: its turn was not used."""
        self._charge(chosen, ready, -turns)

    def _charge(self, chosen: Priority, ready: list[Priority], turns: int) -> None:
        # `turns` rounds of smooth round-robin, all won by `chosen`: every ready
        # priority gains its weight each round, the winner pays the round's total.
        total = sum(self.weights[p] for p in ready)
        for p in ready:
            self._current[p] += turns * self.weights[p]
        self._current[chosen] -= turns * total
