"""Which hosts a partial partition keeps (``hostset.keep_reachable``): the largest group
that all reach each other, in slots, then the one with rank 0's host, then the lower ranks."""

from hvdlite.runner.agent.hostset import EXACT_HOSTS, describe_partition, keep_reachable


def test_no_cut_keeps_every_host():
    assert keep_reachable(["a", "b"], {"a": 1, "b": 1}, []) == (["a", "b"], [])
    assert keep_reachable(["a", "b"], {}, [("a", "a")]) == (["a", "b"], [])  # no self-cut


def test_the_larger_side_in_slots_stays_and_a_tie_keeps_rank_0s_host():
    hosts = ["a", "b", "c"]
    # c cannot reach anyone: a and b stay
    assert keep_reachable(hosts, {"a": 1, "b": 1, "c": 1}, [("a", "c"), ("c", "b")]) == (
        ["a", "b"],
        ["c"],
    )
    # a-b cut, c reaches both: {a, c} and {b, c} tie on slots; rank 0's host a wins
    assert keep_reachable(hosts, {"a": 1, "b": 1, "c": 1}, [("a", "b")]) == (["a", "c"], ["b"])
    # ... unless b holds more slots
    assert keep_reachable(hosts, {"a": 1, "b": 4, "c": 1}, [("a", "b")]) == (["b", "c"], ["a"])


def test_many_hosts_are_cut_greedily_the_most_cut_host_first():
    hosts = [f"h{i}" for i in range(EXACT_HOSTS + 2)]
    cut = [("h3", h) for h in hosts if h != "h3"] + [("h5", "h6")]
    kept, out = keep_reachable(hosts, {}, cut)
    assert out == ["h3", "h6"] and kept == [h for h in hosts if h not in out]


def test_the_words_name_each_cut_and_who_is_left_out():
    assert describe_partition([("a", "b")], ["b"]) == "a and b cannot reach each other; b left out"
    assert describe_partition([("a", "b")], []) == "a and b cannot reach each other"
