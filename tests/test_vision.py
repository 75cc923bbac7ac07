"""Image-text models (data/vision.py, engines/tiny_vlm.py): the built-in tiny Qwen2.5-VL, its
image tokens, and the HF rollout's log-probs on images equal to the training forward's."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from dagrl.data.vision import IMAGE_BLOCK, ImageEncoder, ImageInputs
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.sampling import SamplingParams
from tests.prompts import image_prompts, picture


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("vlm") / "m", "tiny-qwen2.5-vl")
    tokenizer = load_tokenizer(str(path))
    return load_model(str(path)), tokenizer, ImageEncoder.of_model(path, tokenizer)


def test_each_image_pad_becomes_one_token_per_merged_patch(vlm):
    model, tokenizer, encoder = vlm
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    inputs = encoder.encode([Image.new("RGB", (112, 112)), Image.new("RGB", (56, 84))])
    # 112 px = 8 patches of 14 a side, merged 2 x 2: 16 tokens; 56 x 84 -> 4 x 6 -> 6 tokens
    assert inputs.image_grid_thw.tolist() == [[1, 8, 8], [1, 6, 4]]
    assert inputs.pixel_values.shape == (64 + 24, 3 * 2 * 14 * 14)
    raw = tokenizer(f"A{IMAGE_BLOCK}B{IMAGE_BLOCK}", add_special_tokens=False)["input_ids"]
    expanded = encoder.expand(raw, inputs)
    assert expanded.count(encoder.pad_id) == 16 + 6 and len(expanded) == len(raw) + 20
    with pytest.raises(ValueError, match="more images than image pads"):
        encoder.expand(raw[:3], inputs)


def test_rollout_logprobs_on_images_equal_the_training_forward(vlm):
    """Sampled responses of a left-padded batch (rows with 1, 2 and no image, of different
    sizes): the training forward's log-probs of the sampled tokens equal the rollout's, and
    they depend on the pixels (the model reads the image)."""
    model, tokenizer, encoder = vlm
    red = picture((112, 112), "red", (10, 10, 50, 50))
    blue = picture((84, 56), "blue", (30, 5, 80, 40))
    rows = [(f"{IMAGE_BLOCK}HOW MANY?", [red]),
            (f"TWO:{IMAGE_BLOCK}{IMAGE_BLOCK}?", [blue, red]),
            ("no image here?", [])]
    prompt, mask, images = image_prompts(tokenizer, encoder, rows)
    engine = HFRollout(model, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    out = engine.generate(prompt, mask, torch.tensor([1, 2, 3]), SamplingParams(1.0, 0, 1.0),
                          max_new_tokens=12, images=images)
    assert out.response_mask.sum() > 10
    teacher = response_logprobs(model, prompt, mask, out.responses, out.response_mask,
                                images=images).logprobs
    used = out.response_mask.bool()
    torch.testing.assert_close(teacher[used], out.logprobs[used], atol=1e-5, rtol=0)
    other = ImageInputs(torch.flip(images.pixel_values, [0]), images.image_grid_thw)
    moved = response_logprobs(model, prompt, mask, out.responses, out.response_mask,
                              images=other).logprobs
    assert (moved[:2][used[:2]] - teacher[:2][used[:2]]).abs().max() > 1e-4
    # the text-only row does not read the other rows' images
    torch.testing.assert_close(moved[2], teacher[2], atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend, refused", [("native", True), ("vllm", False), ("hf", False),
                                              ("auto", False)])
def test_a_backend_that_takes_no_images_is_refused_for_an_image_text_model(backend, refused):
    from dagrl.config.loader import ConfigError
    from dagrl.train import load_cli_config

    args = ["model.path=builtin:tiny-qwen2.5-vl", f"rollout.backend={backend}"]
    if not refused:
        assert load_cli_config(args).rollout.backend == backend
        return
    with pytest.raises(ConfigError, match=f"rollout.backend={backend} takes no images"):
        load_cli_config(args)


def test_the_loader_puts_each_rows_images_beside_its_image_tokens(vlm, tmp_path):
    """verl's layout (an `images` column, `<image>` in the prompt) read for an image-text
    model: each row's prompt holds one pad per merged patch where its placeholder was, and the
    batch carries the row's encoded images; a row whose image does not decode is refused
    naming the file, the row and the column."""
    import pyarrow.parquet as pq

    from dagrl.data.dataset import PromptLoader
    from dagrl.data.errors import DatasetError
    from dagrl.data.parquet import ParquetPrompts
    from dagrl.data.shapes import make_shapes
    from dagrl.data.vision import IMAGE_FIELD, batch_images

    _, tokenizer, encoder = vlm
    train = make_shapes(tmp_path, n_train=8, n_test=4, size=112)["train"]
    loader = PromptLoader(ParquetPrompts([str(train)], "prompt"), tokenizer, batch_size=4,
                          max_prompt_length=128, images=encoder, shuffle=False)
    batch = loader.next_batch()
    pads = (batch["prompt_ids"] == encoder.pad_id).sum(-1)
    assert pads.tolist() == [16] * 4                      # 112 px: 8 x 8 patches, merged 2 x 2
    images = batch_images(batch)
    assert images.image_grid_thw.tolist() == [[1, 8, 8]] * 4
    assert len(batch[IMAGE_FIELD]) == 4 and images.pixel_values.shape[0] == 4 * 64
    table = pq.read_table(train).to_pylist()
    table[5]["images"] = [{"bytes": b"not a png", "path": None}]
    import pyarrow as pa

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(train)), bad)
    loader = PromptLoader(ParquetPrompts([str(bad)], "prompt"), tokenizer, batch_size=8,
                          max_prompt_length=128, images=encoder, shuffle=False)
    with pytest.raises(DatasetError, match=r"bad.parquet: row 5 .*column images\[0\]: not a "
                                           r"readable image"):
        loader.next_batch()


VLM_RUN = ["model.path=builtin:tiny-qwen2.5-vl", "data.train_files=[builtin:shapes]",
           "data.val_files=[]", "data.max_prompt_length=128", "rollout.max_new_tokens=4",
           "data.train_batch_size=16", "rollout.n=4", "actor.mini_batch_size=16",
           "trainer.total_steps=3", "trainer.torch_threads=1", "trainer.save_final=false",
           "logging.progress_bar=false", "logging.console_every=1000"]


VLM_COMPARED = ["reward/mean", "response/length/mean", "actor/pg_loss", "actor/kl",
                "actor/entropy", "actor/grad_norm"]


@pytest.fixture(scope="module")
def one_worker_vlm_run(tmp_path_factory):
    """The 1-worker run of VLM_RUN: its per-step metrics."""
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.launch import launch
    from tests.dist_helpers import step_metrics

    run_dir = tmp_path_factory.mktemp("vlm-one") / "run"
    launch(load_run_config(None, [f"trainer.run_dir={run_dir}", *VLM_RUN]))
    steps = step_metrics(run_dir)
    # some samples answer right (a digit among 4 random tokens), so the policy moves
    assert len(steps) == 3 and all(m["actor/grad_norm"] > 0 for m in steps)
    return steps


@pytest.mark.slow   # 2 workers, ~25 s; the async run below stays in the main suite
def test_two_workers_train_an_image_text_model_as_one_does(one_worker_vlm_run, tmp_path):
    """Done-when 2 of issue 36: FSDP2 over the vision tower and the language model on 2
    torchrun workers, each generating its shard's samples from their images, reproduces the
    1-worker run for 3 steps."""
    from tests.dist_helpers import assert_same_steps, step_metrics, torchrun_train

    torchrun_train(tmp_path / "two", 2, *VLM_RUN)
    assert_same_steps(step_metrics(tmp_path / "two"), one_worker_vlm_run, VLM_COMPARED,
                      rel=1e-5)


def test_async_trains_an_image_text_model_on_the_sync_runs_batches(one_worker_vlm_run,
                                                                   tmp_path):
    """trainer.mode=async with an image-text model: the rollout rank sends each group's
    images with its samples to the trainer rank (the async buffer), which trains on them; at
    max_staleness 0 the run equals the synchronous one (docs/async.md)."""
    from tests.dist_helpers import assert_same_steps, step_metrics, torchrun_train

    torchrun_train(tmp_path / "async", 2, *VLM_RUN, "trainer.mode=async",
                   "rollout.max_staleness=0")
    steps = step_metrics(tmp_path / "async")
    assert all(m["async/staleness_max"] == 0 for m in steps)
    assert_same_steps(steps, one_worker_vlm_run, VLM_COMPARED, rel=1e-4)


def test_lora_adapts_the_language_model_and_freezes_the_vision_tower(tmp_path):
    """actor.lora.rank with an image-text model: adapters on the language model's linears
    alone (the vision tower's MLP names match `all-linear` too), the run trains them."""
    from dagrl.config.loader import load_config
    from dagrl.config.schema import Config
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'run'}", *VLM_RUN,
                                     "actor.lora.rank=8"])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    trained = [n for n, p in worker.engines.actor.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert any("language_model" in n for n in trained)
    assert not any("visual" in n for n in trained)
    assert len(history) == 3 and all(m["actor/grad_norm"] > 0 for m in history)


def test_the_example_config_loads_with_its_image_text_model_and_task():
    from pathlib import Path

    from dagrl.train import load_cli_config

    example = Path(__file__).parents[1] / "examples" / "vlm_counting.yaml"
    cfg = load_cli_config([str(example)])
    assert cfg.model.path == "builtin:tiny-qwen2.5-vl" and cfg.rollout.backend == "hf"
    assert cfg.data.train_files == ["builtin:shapes"]


def test_sequence_parallelism_is_refused_for_an_image_text_model(capsys):
    """Before any model loads (`dagrl plan` runs the same check as `dagrl train`)."""
    from dagrl.cli import main

    assert main(["plan", "model.path=builtin:tiny-qwen2.5-vl", "trainer.n_workers=2",
                 "actor.sequence_parallel_size=2"]) == 2
    assert "sequence_parallel_size=2: an image-text model's M-RoPE positions" in \
        capsys.readouterr().err


def test_tensor_parallelism_is_refused_for_an_image_text_model(capsys):
    from dagrl.cli import main

    assert main(["plan", "model.path=builtin:tiny-qwen2.5-vl", "trainer.n_workers=2",
                 "actor.tensor_parallel_size=2"]) == 2
    assert "tensor_parallel_size=2: an image-text model's vision tower has no tensor-parallel" \
        in capsys.readouterr().err


def test_packed_rows_are_refused_for_an_image_text_model():
    from dagrl.config.loader import ConfigError
    from dagrl.engines.layout import EngineLayout
    from dagrl.train import load_cli_config

    cfg = load_cli_config(["model.path=builtin:tiny-qwen2.5-vl", "model.pack_sequences=true"])
    with pytest.raises(ConfigError, match="model.pack_sequences=true: builtin:tiny-qwen2.5-vl "
                                          "is an image-text model"):
        EngineLayout.of(cfg, 1)


def test_partial_rollout_is_refused_for_an_image_text_model():
    from dagrl.config.loader import ConfigError
    from dagrl.train import load_cli_config

    with pytest.raises(ConfigError, match="partial rollout does not carry the images"):
        load_cli_config(["model.path=builtin:tiny-qwen2.5-vl", "trainer.mode=async",
                         "trainer.n_workers=2", "rollout.partial=true"])


def test_validation_samples_and_the_report_show_each_answer_beside_its_image(tmp_path):
    """logging.val_generations keeps each kept sample's picture as a thumbnail, and the run
    report shows it beside the answer, the ground truth and the score."""
    import base64
    import io
    import json

    from dagrl.config.presets import load_run_config
    from dagrl.observe.report import render_report
    from dagrl.runtime.launch import launch

    run_dir = tmp_path / "run"
    args = [a for a in VLM_RUN if not a.startswith(("data.val_files", "trainer.total_steps"))]
    launch(load_run_config(None, [f"trainer.run_dir={run_dir}", *args,
                                  "data.val_files=[builtin:shapes]", "trainer.total_steps=1",
                                  "trainer.val_before_train=true",
                                  "logging.val_generations=3"]))
    records = [json.loads(line) for line in (run_dir / "val_generations.jsonl").open()]
    assert len(records) == 3 and all(len(r["images"]) == 1 for r in records)
    thumb = Image.open(io.BytesIO(base64.b64decode(records[0]["images"][0])))
    assert thumb.size == (96, 96)          # the 112 px picture, shrunk
    assert len(thumb.convert("RGB").getcolors(96 * 96)) > 1   # white and the shapes
    html = render_report(run_dir)
    samples = html[html.index("<section id='samples'>"):html.index("<section id='trace'>")]
    assert samples.count("<img class='thumb'") == 3
    assert records[0]["images"][0] in samples and "ground truth" in samples
