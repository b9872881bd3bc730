"""A partial partition: which hosts stay together when some pairs cannot reach each other.

A switch that drops the traffic between two hosts while both still reach the launcher
leaves every rank alive and every heartbeat answered, yet no collective can finish.
The starter probes between the hosts' task services (``Starter.cut_links``); given the
pairs that failed, :func:`keep_reachable` picks the largest set of hosts that all reach
each other -- counted in slots, ties to the set that holds rank 0 (the state the others
will receive) and then to the lower ranks -- and the hosts it leaves out.  One-way drops
count as cuts: a TCP exchange needs both directions.
"""

import itertools
from typing import Dict, FrozenSet, List, Sequence, Set, Tuple

#: above this many hosts the exact search (every subset) gives way to a greedy one
EXACT_HOSTS = 12


def keep_reachable(hosts: Sequence[str], slots: Dict[str, int],
                   cut: Sequence[Tuple[str, str]]) -> Tuple[List[str], List[str]]:
    """``(kept, left_out)``: the hosts (in ``hosts``' order, which is rank order) to keep,
    all reaching each other, and the rest."""
    broken: Set[FrozenSet[str]] = {frozenset(p) for p in cut if p[0] != p[1]}
    if not broken:
        return list(hosts), []
    order = {h: i for i, h in enumerate(hosts)}

    def clique(group) -> bool:
        return not any(frozenset(p) in broken for p in itertools.combinations(group, 2))

    def score(group) -> tuple:
        # most slots, then rank 0's host inside, then the lowest ranks
        return (sum(slots.get(h, 1) for h in group), hosts[0] in group,
                [-order[h] for h in group])

    if len(hosts) <= EXACT_HOSTS:
        groups = (g for n in range(len(hosts), 0, -1)
                  for g in itertools.combinations(hosts, n) if clique(g))
        best = max(groups, key=score)
    else:
        best = list(hosts)
        while not clique(best):
            # leave out the host with the most cuts (the latest in rank order on a tie)
            worst = max(best, key=lambda h: (sum(frozenset((h, o)) in broken for o in best),
                                             order[h]))
            best.remove(worst)
    kept = [h for h in hosts if h in best]
    return kept, [h for h in hosts if h not in best]


def describe(cut: Sequence[Tuple[str, str]], left_out: Sequence[str]) -> str:
    """``tbh1 and tbh2 cannot reach each other; tbh2 left out``."""
    links = "; ".join(f"{a} and {b} cannot reach each other" for a, b in cut)
    return links + (f"; {', '.join(left_out)} left out" if left_out else "")
