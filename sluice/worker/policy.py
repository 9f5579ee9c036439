"""Which priority the next message comes from.

Smooth weighted round-robin over the priorities that have work: with weights
high=6, normal=3, low=1 and all three busy, out of every 10 messages 6 are high,
3 normal and 1 low, interleaved. `high` is preferred but `low` is never starved;
an idle priority's share goes to the others.
"""

from __future__ import annotations

from sluice.contract import Priority


class WeightedPriorityPolicy:
    def __init__(self, weights: dict[Priority, int]):
        if any(w < 1 for w in weights.values()):
            raise ValueError("every priority needs a weight of at least 1")
        self.weights = dict(weights)
        self._current = {p: 0 for p in weights}

    def pick(self, ready: list[Priority]) -> Priority:
        if not ready:
            raise ValueError("no priority has work")
        total = 0
        for p in ready:
            self._current[p] += self.weights[p]
            total += self.weights[p]
        # Ties go to the higher priority (Priority is declared high -> low).
        chosen = max(ready, key=lambda p: (self._current[p], -list(Priority).index(p)))
        self._current[chosen] -= total
        return chosen

    def refund(self, chosen: Priority, ready: list[Priority]) -> None:
        """Undo the pick(ready) that chose `chosen`: its turn was not used."""
        for p in ready:
            self._current[p] -= self.weights[p]
        self._current[chosen] += sum(self.weights[p] for p in ready)
