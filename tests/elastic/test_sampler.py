"""ElasticSampler's sharding and its position across a change of world size (no processes)."""

import pytest

from hvdlite.torch import elastic

pytestmark = pytest.mark.timeout(30)


def _world(monkeypatch, size, rank):
    monkeypatch.setattr(elastic, "size", lambda: size)
    monkeypatch.setattr(elastic, "rank", lambda: rank)


def _shards(monkeypatch, dataset, size, state=None, shuffle=True):
    out = []
    for r in range(size):
        _world(monkeypatch, size, r)
        s = elastic.ElasticSampler(dataset, shuffle=shuffle, seed=3)
        if state is not None:
            s.load_state_dict(state)
        out.append((s, list(iter(s))))
    return out


def test_shards_cover_the_epoch_once_and_resharding_skips_nothing(monkeypatch):
    data = list(range(30))
    shards = _shards(monkeypatch, data, 3)
    assert sorted(i for _, idx in shards for i in idx) == data
    # two batches of 4 on every rank, recorded on rank 0 only: it knows every rank's batches
    sampler0 = shards[0][0]
    sampler0.record_batch(0, 4)
    sampler0.record_batch(1, 4)
    done = set(i for _, idx in shards for i in idx[:8])
    assert sampler0.processed_indices == done and len(done) == 24
    state = sampler0.state_dict()
    # a reset to 2 ranks: the 6 samples left are shared out, none twice, none lost
    after = _shards(monkeypatch, data, 2, state)
    left = [i for _, idx in after for i in idx]
    assert sorted(left) == sorted(set(data) - done) and len(after[0][1]) == 3


def test_uneven_remainder_is_padded_and_set_epoch_starts_over(monkeypatch):
    data = list(range(7))
    shards = _shards(monkeypatch, data, 2, shuffle=False)
    assert [idx for _, idx in shards] == [[0, 2, 4, 6], [1, 3, 5, 0]]
    s = shards[0][0]
    s.record_batch(0, 2)
    assert s.processed_indices == {0, 1, 2, 3}
    s.set_epoch(1)
    assert s.processed_indices == set() and len(s) == 4
