"""A grouped in-place allreduce's kept flat buffer (hvdlite.torch.grouped_packing)."""

import pytest
import torch

from hvdlite.torch import grouped_packing as gp


@pytest.fixture(autouse=True)
def _empty():
    gp._KEPT.clear()
    yield
    gp._KEPT.clear()


def _group(step):
    return [torch.full((3,), float(step)), torch.full((2, 2), float(step) + 0.5).t()]


@pytest.mark.timeout(30)
def test_a_second_submission_before_the_first_finished_packs_into_its_own_buffer():
    a, b = _group(1), _group(2)
    flat_a, digest_a, kept_a, one_d = gp.pack(a, torch.float32, "g", inplace=True)
    flat_b, digest_b, kept_b, _ = gp.pack(b, torch.float32, "g", inplace=True)
    assert digest_a == digest_b and not one_d
    assert kept_a is not None and kept_b is not None and kept_a is not kept_b
    assert flat_a.data_ptr() != flat_b.data_ptr()
    assert flat_a.tolist() == [1.0] * 3 + [1.5] * 4
    assert flat_b.tolist() == [2.0] * 3 + [2.5] * 4
    # each finish copies its own buffer's (here: doubled) values back, once
    flat_a.mul_(2)
    finish = gp.finisher(a, True, kept_a, one_d)
    assert finish([flat_a]) == a and a[0].tolist() == [2.0] * 3 and a[1].eq(3.0).all()
    flat_a.fill_(-1)
    finish([flat_a])  # a second synchronize leaves the tensors alone
    assert a[0].tolist() == [2.0] * 3
    # the buffer given back is what the next call of that name and shape packs into
    c = _group(5)
    flat_c, _, kept_c, _ = gp.pack(c, torch.float32, "g", inplace=True)
    assert kept_c is kept_a and flat_c.data_ptr() == flat_a.data_ptr()
    assert flat_c.tolist() == [5.0] * 3 + [5.5] * 4


@pytest.mark.timeout(30)
def test_no_buffer_is_kept_for_other_shapes_unnamed_or_out_of_place_groups():
    one = [torch.ones(4), torch.ones(2)]
    flat, _, kept, one_d = gp.pack(one, torch.float32, "g", inplace=True)
    assert one_d and kept is not None
    gp.finisher(one, True, kept, one_d)([flat])
    other = [torch.ones(2), torch.ones(4)]  # same name, other shapes
    _, _, kept2, _ = gp.pack(other, torch.float32, "g", inplace=True)
    assert kept2 is not kept
    for name, inplace in ((None, True), ("h", False)):
        flat, _, kept3, _ = gp.pack(one, torch.float32, name, inplace)
        assert kept3 is None and flat.tolist() == [1.0] * 6
    out = gp.finisher(one, False, None, True)([torch.arange(6.0)])
    assert [o.tolist() for o in out] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]


@pytest.mark.timeout(30)
def test_kept_buffers_stay_within_the_byte_budget(monkeypatch):
    monkeypatch.setattr(gp, "KEEP_TOTAL_BYTES", 100)
    for name in ("a", "b", "c"):
        group = [torch.ones(10), torch.ones(5)]  # 60 bytes each
        flat, _, kept, one_d = gp.pack(group, torch.float32, name, inplace=True)
        gp.finisher(group, True, kept, one_d)([flat])
    assert list(gp._KEPT) == [("a", torch.float32, hash((torch.Size([10]), torch.Size([5]))))]
