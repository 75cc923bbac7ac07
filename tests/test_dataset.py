"""Reading verl-layout parquet, tokenization, and the seeded prompt loader (one worker)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagrl.data.dataset import DatasetError, PromptLoader, encode_prompt
from dagrl.data.parquet import ParquetPrompts


def verl_rows():
    """Rows exactly as verl's gsm8k preprocessing writes them (prompt as a message list)."""
    return [
        {"data_source": "openai/gsm8k",
         "prompt": [{"role": "user", "content": f"what is {i}+{i}? answer after ####"}],
         "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
         "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}",
                        "question": f"what is {i}+{i}?"}}
        for i in range(10)
    ]


def test_reads_verl_layout(tmp_path, tokenizer):
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path, row_group_size=4)
    source = ParquetPrompts([str(path)])
    assert len(source) == 10
    rows = source.read([9, 0, 5])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["18", "0", "10"]
    assert rows[0]["extra_info"]["answer"] == "#### 18"
    assert source.row_groups_read == 3   # rows 9, 0 and 5 live in three different row groups

    loader = PromptLoader(source, tokenizer, batch_size=4, seed=0, max_prompt_length=48)
    batch = loader.next_batch()
    assert len(batch) == 4
    assert set(batch.keys()) >= {"prompt_ids", "prompt_mask", "uid", "data_source",
                                 "ground_truth", "extra_info", "prompt"}
    for i in range(4):
        row = int(batch["row_index"][i])
        ids = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        assert ids == encode_prompt(tokenizer, verl_rows()[row]["prompt"])
        assert batch["ground_truth"][i] == str(2 * row)
        assert batch["extra_info"][i]["index"] == row
        # left padding: the prompt ends in the last column
        assert batch["prompt_mask"][i, -1] == 1


def test_chat_template_is_used(tokenizer):
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "1+2="}])
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == "1+2="


def test_missing_column_names_file_and_column(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in verl_rows()]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=r"bad.parquet: missing column\(s\) \['reward_model'\]"):
        ParquetPrompts([str(path)])


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DatasetError, match="no such parquet file"):
        ParquetPrompts([str(tmp_path / "nope.parquet")])
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="corrupt.parquet: not a readable parquet"):
        ParquetPrompts([str(bad)])


def test_long_prompt_errors_or_truncates(arith_files, tokenizer):
    source = ParquetPrompts([str(arith_files["train"])])
    loader = PromptLoader(source, tokenizer, batch_size=4, max_prompt_length=3)
    with pytest.raises(DatasetError, match="max_prompt_length=3"):
        loader.next_batch()
    loader = PromptLoader(source, tokenizer, batch_size=4, max_prompt_length=3, truncation="left")
    batch = loader.next_batch()
    assert batch["prompt_mask"].sum(-1).tolist() == [3, 3, 3, 3]


def test_epochs_cover_dataset_and_state_resumes(arith_files, tokenizer):
    source = ParquetPrompts([str(arith_files["train"])])   # 400 rows
    def make():
        return PromptLoader(source, tokenizer, batch_size=32, seed=3, max_prompt_length=16)

    loader = make()
    assert loader.batches_per_epoch == 12 and loader.dropped_per_epoch == 16
    seen = np.concatenate([loader.next_batch()["row_index"].numpy() for _ in range(12)])
    assert len(set(seen.tolist())) == 384          # no repeats inside an epoch
    assert loader.epoch == 1 and loader.batch_in_epoch == 0
    # an epoch's order differs from the next one's
    assert not np.array_equal(loader.epoch_order(0), loader.epoch_order(1))

    loader = make()
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch()["row_index"].tolist() for _ in range(10)]  # crosses the epoch
    restored = make()
    restored.load_state_dict(state)
    assert [restored.next_batch()["row_index"].tolist() for _ in range(10)] == expected


def test_worker_slices_concatenate_to_the_global_batch(arith_files, tokenizer):
    source = ParquetPrompts([str(arith_files["train"])])
    kw = dict(batch_size=32, seed=1, max_prompt_length=16)
    whole = PromptLoader(source, tokenizer, **kw).next_batch()
    parts = [PromptLoader(source, tokenizer, rank=r, world_size=4, **kw).next_batch()
             for r in range(4)]
    assert np.concatenate([p["row_index"].numpy() for p in parts]).tolist() == \
        whole["row_index"].tolist()


def test_tail_pad_fills_the_last_batch_from_the_next_epoch(arith_files, tokenizer):
    source = ParquetPrompts([str(arith_files["train"])])   # 400 rows: 12 full batches + 16
    loader = PromptLoader(source, tokenizer, batch_size=32, seed=3, max_prompt_length=16,
                          tail="pad")
    assert loader.batches_per_epoch == 13 and loader.dropped_per_epoch == 0
    batches = [loader.next_batch()["row_index"].tolist() for _ in range(13)]
    epoch0 = [r for b in batches for r in b]
    assert set(epoch0[:400]) == set(range(400))             # every row of the epoch is used
    assert epoch0[400:] == loader.epoch_order(1)[:16].tolist()   # padded from the next order
    assert loader.epoch == 1 and loader.batch_in_epoch == 0


def test_reading_a_row_past_the_end_names_the_files_and_their_size(arith_files):
    source = ParquetPrompts([arith_files["test"]], "prompt")
    with pytest.raises(IndexError, match=rf"rows \[{len(source)}\] do not exist: .*test.parquet "
                                         rf"hold {len(source)} rows"):
        source.read([0, len(source)])
