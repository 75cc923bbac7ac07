from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from dagrl.data.batch import Batch


def make_batch(n: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        tensors={
            "input_ids": torch.arange(n * 4).view(n, 4),
            "old_logprobs": torch.randn(n, 3, generator=g),
            "scores": torch.arange(n, dtype=torch.float32),
        },
        non_tensors={
            "uid": [f"u{i}" for i in range(n)],
            # same-length inner lists: a naive np.array would make this 2-D
            "tokens": [[i, i + 1] for i in range(n)],
            "extra_info": [{"idx": i, "tags": ["a"] * i} for i in range(n)],
        },
    )


def assert_batch_equal(a: Batch, b: Batch) -> None:
    assert len(a) == len(b)
    assert a.keys() == b.keys()
    for k, t in a.tensors.items():
        assert t.dtype == b[k].dtype and t.shape == b[k].shape, k
        assert torch.equal(t, b[k]), k
    for k, v in a.non_tensors.items():
        assert v.dtype == object and v.ndim == 1, k
        assert v.tolist() == b[k].tolist(), k


# ---- construction / fields -------------------------------------------------------------


def test_construction_and_fields():
    b = make_batch(5)
    assert len(b) == 5
    assert isinstance(b.tensors, TensorDict) and b.tensors.batch_size == torch.Size([5])
    assert b.keys() == ["input_ids", "old_logprobs", "scores", "uid", "tokens", "extra_info"]
    assert b["tokens"].shape == (5,) and b["tokens"][2] == [2, 3]
    assert b["extra_info"][3] == {"idx": 3, "tags": ["a", "a", "a"]}
    assert "uid" in b and "scores" in b and "nope" not in b
    assert Batch(batch_size=3).keys() == [] and len(Batch(batch_size=3)) == 3


def test_construction_from_tensordict_does_not_alias_container():
    td = TensorDict({"x": torch.zeros(3, 2)}, batch_size=[3])
    b = Batch(td, {"s": np.array(["a", "b", "c"])})
    b["y"] = torch.ones(3)
    assert "y" not in td.keys()
    assert b["x"].data_ptr() == td["x"].data_ptr()  # tensors themselves are shared
    assert b["s"].dtype == object


def test_construction_errors():
    with pytest.raises(ValueError, match=r"'scores' has 4 samples but 'input_ids' has 3"):
        Batch({"input_ids": torch.zeros(3, 2), "scores": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"'uid' has 2 samples but 'x' has 3"):
        Batch({"x": torch.zeros(3)}, {"uid": ["a", "b"]})
    with pytest.raises(ValueError, match=r"'x' has 3 samples but 'batch_size' has 2"):
        Batch({"x": torch.zeros(3)}, batch_size=2)
    with pytest.raises(ValueError, match="pass batch_size"):
        Batch()
    with pytest.raises(ValueError, match=r"both tensor and non-tensor"):
        Batch({"k": torch.zeros(2)}, {"k": [1, 2]})
    with pytest.raises(ValueError, match=r"'grid' must be 1-D, got shape \(2, 2\)"):
        Batch(non_tensors={"grid": np.zeros((2, 2))})
    with pytest.raises(TypeError, match=r"'s' must be a list"):
        Batch(non_tensors={"s": "abc"})
    with pytest.raises(ValueError, match=r"'c' needs a leading batch dim"):
        Batch({"c": torch.tensor(1.0)})


def test_get_set_pop():
    b = make_batch(3)
    b["adv"] = torch.ones(3, 3)
    b["gt"] = ("x", "y", "z")
    b["arr"] = np.array([1.5, 2.5, 3.5])
    assert b.keys()[3] == "adv" and b.keys()[-2:] == ["gt", "arr"]
    assert torch.equal(b["adv"], torch.ones(3, 3))
    assert b["gt"].tolist() == ["x", "y", "z"] and b["arr"].dtype == object
    b["scores"] = torch.full((3,), 7.0)  # overwrite same kind
    assert b["scores"].tolist() == [7.0, 7.0, 7.0]

    with pytest.raises(KeyError, match=r"'missing'.*input_ids"):
        b["missing"]
    with pytest.raises(ValueError, match=r"'adv2' has 4 samples.*batch has 3"):
        b["adv2"] = torch.ones(4)
    with pytest.raises(ValueError, match=r"'gt2' has 2 samples but the batch has 3"):
        b["gt2"] = ["a", "b"]
    with pytest.raises(ValueError, match=r"'uid' is a non-tensor field"):
        b["uid"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'scores' is a tensor field"):
        b["scores"] = [1, 2, 3]
    with pytest.raises(TypeError, match="select"):
        b[0]

    assert b.pop("gt").tolist() == ["x", "y", "z"] and "gt" not in b
    assert b.pop("adv").shape == (3, 3) and "adv" not in b
    with pytest.raises(KeyError, match="'gt'"):
        b.pop("gt")


# ---- row operations --------------------------------------------------------------------


@pytest.mark.parametrize(
    "indices",
    [[4, 0, 0, 2], torch.tensor([4, 0, 0, 2]), np.array([4, 0, 0, 2]), [-1, 0, 0, 2]],
    ids=["list", "tensor", "ndarray", "negative"],
)
def test_select_any_order_with_repeats(indices):
    b = make_batch(5)
    s = b.select(indices)
    assert len(s) == 4
    assert s["uid"].tolist() == ["u4", "u0", "u0", "u2"]
    assert s["scores"].tolist() == [4.0, 0.0, 0.0, 2.0]
    assert torch.equal(s["input_ids"], b["input_ids"][[4, 0, 0, 2]])
    assert s["extra_info"][0] is b["extra_info"][4]  # elements are not deep-copied
    s["input_ids"][0, 0] = -1  # select copies tensor storage
    assert b["input_ids"][4, 0] == 16


def test_select_bool_mask_and_errors():
    b = make_batch(5)
    mask = [True, False, True, False, True]
    for m in (mask, torch.tensor(mask), np.array(mask)):
        s = b.select(m)
        assert s["uid"].tolist() == ["u0", "u2", "u4"]
        assert s["tokens"].tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="mask has length 2 but the batch has 5"):
        b.select([True, False])
    with pytest.raises(IndexError, match="out of range for batch of 5"):
        b.select([0, 5])
    with pytest.raises(TypeError, match="integers or a bool mask"):
        b.select(torch.tensor([0.0, 1.0]))


def test_slice_is_view_and_strict():
    b = make_batch(5)
    s = b.slice(1, 3)
    assert s["uid"].tolist() == ["u1", "u2"]
    s["input_ids"][0, 0] = -1
    assert b["input_ids"][1, 0] == -1
    with pytest.raises(IndexError, match=r"\[2, 7\)"):
        b.slice(2, 7)
    with pytest.raises(IndexError, match=r"\[3, 2\)"):
        b.slice(3, 2)


@pytest.mark.parametrize("sizes", [2, 5, 7, [2, 0, 3], [0, 5, 0], [1, 1, 1, 1, 1]])
def test_split_concat_roundtrip(sizes):
    b = make_batch(5)
    parts = b.split(sizes)
    if isinstance(sizes, int):
        assert [len(p) for p in parts] == {2: [2, 2, 1], 5: [5], 7: [5]}[sizes]
    else:
        assert [len(p) for p in parts] == sizes
    assert_batch_equal(Batch.concat(parts), b)


@pytest.mark.parametrize("n,expect", [(2, [3, 2]), (3, [2, 2, 1]), (7, [1, 1, 1, 1, 1, 0, 0])])
def test_chunk_concat_roundtrip(n, expect):
    b = make_batch(5)
    parts = b.chunk(n)
    assert [len(p) for p in parts] == expect
    assert parts[-1].keys() == b.keys()
    assert parts[-1]["input_ids"].shape[1:] == (4,)
    assert_batch_equal(Batch.concat(parts), b)


def test_split_chunk_errors():
    b = make_batch(5)
    with pytest.raises(ValueError, match=r"sum to 4 but the batch has 5"):
        b.split([2, 2])
    with pytest.raises(ValueError, match="must be >= 0"):
        b.split([6, -1])
    with pytest.raises(ValueError, match="> 0"):
        b.split(0)
    with pytest.raises(ValueError, match="> 0"):
        b.chunk(0)


def test_concat_copies_and_keeps_order():
    a, c = make_batch(3), make_batch(2)
    out = Batch.concat([a, c])
    assert out["uid"].tolist() == ["u0", "u1", "u2", "u0", "u1"]
    out["scores"][0] = 99.0
    assert a["scores"][0] == 0.0


def test_concat_errors_name_field():
    a = make_batch(2)
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"batch 1.*missing \['uid'\], extra \[\]"):
        Batch.concat([a, a.drop_keys(["uid"])])
    extra = make_batch(2)
    extra["more"] = [1, 2]
    with pytest.raises(ValueError, match=r"batch 2.*missing \[\], extra \['more'\]"):
        Batch.concat([a, a, extra])
    flipped = a.drop_keys(["scores"])
    flipped["scores"] = [0.0, 1.0]
    with pytest.raises(ValueError, match=r"'scores' is a tensor in batch 0 but not in batch 1"):
        Batch.concat([a, flipped])
    wide = make_batch(2)
    wide["input_ids"] = torch.zeros(2, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"'input_ids' is \[2, 4\].*\[2, 6\]"):
        Batch.concat([a, wide])
    # TensorDict cat would promote silently; we refuse.
    f64 = make_batch(2)
    f64["scores"] = f64["scores"].double()
    with pytest.raises(ValueError, match=r"'scores'.*float32.*float64.*batch 1"):
        Batch.concat([a, f64])


def test_repeat_interleave_order():
    b = make_batch(3)
    r = b.repeat_interleave(2)
    assert r["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert torch.equal(r["input_ids"], b["input_ids"].repeat_interleave(2, dim=0))
    assert r["tokens"].tolist() == [[0, 1], [0, 1], [1, 2], [1, 2], [2, 3], [2, 3]]
    with pytest.raises(ValueError, match="repeat count"):
        b.repeat_interleave(0)


def test_empty_batch_through_every_operation():
    e = make_batch(5).slice(0, 0)
    assert len(e) == 0 and e["input_ids"].shape == (0, 4) and e["uid"].shape == (0,)
    for out in (
        e.select([]),
        e.select(torch.zeros(0, dtype=torch.bool)),
        e.repeat_interleave(3),
        Batch.concat([e, e]),
        e.to("cpu"),
        pickle.loads(pickle.dumps(e)),
        *e.split(2),
        *e.split([0, 0]),
        *e.chunk(3),
    ):
        assert_batch_equal(out, e)
        assert out["old_logprobs"].shape == (0, 3)
    assert len(e.split(2)) == 1 and len(e.chunk(3)) == 3
    assert e.select_keys(["uid"]).keys() == ["uid"]
    assert e.drop_keys(["uid"]).keys() == [k for k in e.keys() if k != "uid"]
    assert e.nbytes() == 0
    assert_batch_equal(Batch.concat([e, make_batch(2), e]), make_batch(2))
    keyless = Batch(batch_size=0)
    assert len(Batch.concat([keyless, Batch(batch_size=2)])) == 2


def test_select_keys_drop_keys_share_storage():
    b = make_batch(4)
    s = b.select_keys(["uid", "scores"])
    assert s.keys() == ["scores", "uid"] and len(s) == 4
    assert s["scores"].data_ptr() == b["scores"].data_ptr() and s["uid"] is b["uid"]
    d = b.drop_keys(["input_ids", "extra_info"])
    assert d.keys() == ["old_logprobs", "scores", "uid", "tokens"]
    d["new"] = torch.zeros(4)  # adding to the new batch leaves the original alone
    assert "new" not in b
    assert b.select_keys([]).keys() == [] and len(b.select_keys([])) == 4
    with pytest.raises(KeyError, match=r"\['nope'\]"):
        b.select_keys(["uid", "nope"])
    with pytest.raises(KeyError, match=r"\['nope'\]"):
        b.drop_keys(["nope"])


def test_nbytes_repr_to_pickle():
    b = make_batch(4)
    assert b.nbytes() == sum(t.numel() * t.element_size() for t in b.tensors.values())
    assert b.nbytes() == 4 * 4 * 8 + 4 * 3 * 4 + 4 * 4
    assert repr(b) == (
        "Batch(n=4, tensors={input_ids: [4, 4] int64, old_logprobs: [4, 3] float32, "
        "scores: [4] float32}, non_tensors=[uid, tokens, extra_info])"
    )
    moved = b.to("cpu")
    assert_batch_equal(moved, b)
    assert_batch_equal(pickle.loads(pickle.dumps(b)), b)
