"""Loading Hugging Face causal LMs, and building the tiny models used by tests and the default run.

Every model, tiny or real, is loaded from a local directory by `load_model` / `load_tokenizer`:
a tiny model is first *written* as an ordinary HF directory (config.json, model.safetensors,
tokenizer.json), so tests exercise the same loading path as a user's checkpoint.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from dagrl.config.model_source import (
    BUILTIN_PREFIX,
    PACKAGE_PREFIX,
    TINY_FAMILIES,
    TINY_VLM,
    check_model_dir,
    package_dir,
)
from dagrl.data.vision import reads_images
from dagrl.device import host_device
from dagrl.engines.attention import resolve_attn_implementation
from dagrl.engines.tiny_vlm import (
    EXTRA_CHARACTERS,
    add_vision_tokens,
    tiny_image_processor,
    tiny_vlm_config,
)

logger = logging.getLogger(__name__)

# The character vocabulary of the tiny models: 4 specials, digits, lowercase letters and
# `+-*=:?. ` (enough for the arithmetic and string tasks of `dagrl data make`).
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*=:?. ")
# The chat template only concatenates message contents after BOS: the tiny model has no roles.
# A tool's result (multi-turn rollouts, format=tiny) is followed by a space, so the policy's
# next turn starts after a separator.
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                      "{% if m['role'] == 'tool' %} {% endif %}{% endfor %}")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def build_char_tokenizer(extra_characters: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code with the `tokenizers` library.

    Each character is one token (a regex pre-tokenizer isolates every character, a word-level
    model maps it to an id) and decoding fuses tokens back without spaces. `extra_characters`
    follow the tiny models' own (the tiny image-text model's, engines/tiny_vlm.py).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    characters = SPECIAL_TOKENS + CHARACTERS + list(extra_characters or [])
    vocab = {tok: i for i, tok in enumerate(characters)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_model_config(family: str, vocab_size: int, hidden_size: int, layers: int,
                      max_positions: int = 256, heads: int = 2, kv_heads: int | None = None):
    """Config of a small randomly initialised Qwen2 or Llama causal LM (GQA, tied embeddings).

    Two query heads share each key/value head unless `kv_heads` says otherwise; by default 2
    heads: head size hidden/2, 32 at the default width, the smallest vLLM's CPU attention runs
    (so rollout.backend=vllm works on the default task)."""
    kv_heads = kv_heads or max(heads // 2, 1)
    common = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions, "tie_word_embeddings": True,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }
    if family == "tiny-qwen2":
        return Qwen2Config(**common)
    if family == "tiny-llama":
        return LlamaConfig(**common)
    if family == TINY_VLM:
        return tiny_vlm_config(tiny_tokenizer(family), hidden_size, layers, heads)
    raise ValueError(f"unknown tiny model {family!r}; choose one of {', '.join(TINY_FAMILIES)}")


def write_tiny_model(out_dir: str | Path, family: str = "tiny-qwen2", *, hidden_size: int = 64,
                     layers: int = 2, seed: int = 0, heads: int = 2,
                     kv_heads: int | None = None) -> Path:
    """Write a seeded tiny model and its character tokenizer as a HF directory; returns it.

    Written into a temporary sibling directory and renamed into place, so a crash never leaves
    a half-written model that a later run would try to load.
    """
    out_dir = Path(out_dir)
    tokenizer = tiny_tokenizer(family)
    config = tiny_model_config(family, len(tokenizer), hidden_size, layers, heads=heads,
                               kv_heads=kv_heads)
    hf_logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = causal_lm_class(config).from_config(config)
    # an image-text model's directory holds its image processor too
    savers = (tiny_image_processor(),) if family == TINY_VLM else ()
    return write_model_dir(out_dir, model, tokenizer, savers=savers)


def tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The character tokenizer of a tiny model family (the image-text one's has more
    characters and the vision tokens, engines/tiny_vlm.py)."""
    if family == TINY_VLM:
        return add_vision_tokens(build_char_tokenizer(EXTRA_CHARACTERS))
    return build_char_tokenizer()


def write_model_dir(out_dir: Path, model, tokenizer, extra: dict[str, str] | None = None,
                    savers: tuple = ()) -> Path:
    """Save `model` and `tokenizer` (and `extra` text files, by name, and each of `savers`'
    `save_pretrained`: an image processor) as the HF directory `out_dir`, written in a
    temporary sibling and renamed into place, so a crash never leaves a half-written model
    that a later run would try to load."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for saver in savers:
            saver.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_builtin_model(path: str, out_root: str | Path, *, hidden_size: int, layers: int,
                          seed: int, heads: int = 2) -> str:
    """Turn `builtin:tiny-qwen2` into a written model directory under `out_root`, and
    `package:NAME` into that installed package's directory; real paths pass through."""
    if path.startswith(PACKAGE_PREFIX):
        return package_dir(path)
    if not path.startswith(BUILTIN_PREFIX):
        return path
    family = path[len(BUILTIN_PREFIX):]
    if family not in TINY_FAMILIES:
        raise ValueError(f"model.path: unknown built-in model {path!r}; choose one of "
                         + ", ".join(BUILTIN_PREFIX + f for f in TINY_FAMILIES))
    shape = f"h{hidden_size}-l{layers}" + (f"-a{heads}" if heads != 2 else "")
    out = Path(out_root) / f"{family}-{shape}-s{seed}"
    if not (out / "config.json").exists():
        write_tiny_model(out, family, hidden_size=hidden_size, layers=layers, seed=seed,
                         heads=heads)
    return str(out)


class TokenizerError(ValueError):
    """A model directory whose tokenizer cannot be used; the message names the directory."""


def _unusable_token(tok: PreTrainedTokenizerBase, kind: str, vocab_size: int | None) -> str:
    """Why the tokenizer's `kind` ("pad" or "eos") token cannot be used; "" if it can."""
    token, token_id = getattr(tok, f"{kind}_token"), getattr(tok, f"{kind}_token_id")
    name, article = ("EOS", "an") if kind == "eos" else ("pad", "a")
    if token_id is None:
        return f"no {name} token"
    if vocab_size is not None and token_id >= vocab_size:
        return (f"{article} {name} token {token!r} (id {token_id}) outside the model's "
                f"vocab_size={vocab_size}")
    return ""


def load_tokenizer(path: str, gguf_file: str = "") -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model directory. It must have an EOS token the model knows;
    without a pad token, EOS stands in for it (as in verl and TRL)."""
    check_model_dir(path, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if not gguf_file and _declares_plain_tokenizer_json(path):
        # transformers 5's AutoTokenizer swaps in the model type's tokenizer class (Qwen2's
        # byte-level pre-tokenizer for the tiny qwen2 model, which drops its spaces) even when
        # tokenizer_config.json asks for tokenizer.json as it is: honour that request.
        tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    # Without tokenizer files transformers builds a near-empty tokenizer from the model type
    # instead of failing; it would encode every prompt to nothing.
    if not tok("a", add_special_tokens=False)["input_ids"]:
        raise TokenizerError(f"model.path: the tokenizer in {path!r} is empty (no tokenizer.json "
                             "or vocabulary files there?)")
    # transformers may also default a missing special token to one the model has no embedding
    # for (Qwen2's '<|endoftext|>', appended at id len(vocab)): such a token counts as missing.
    config = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    no_pad = _unusable_token(tok, "pad", vocab_size)
    no_eos = _unusable_token(tok, "eos", vocab_size)
    if no_pad and no_eos:
        raise TokenizerError(f"model.path: the tokenizer in {path!r} has neither a pad nor an EOS "
                             f"token ({no_pad}; {no_eos}); set pad_token and eos_token in its "
                             "tokenizer_config.json")
    if no_eos:
        raise TokenizerError(f"model.path: the tokenizer in {path!r} has {no_eos}: generation "
                             "could not stop; set eos_token in its tokenizer_config.json")
    if no_pad:
        logger.warning("the tokenizer in %r has %s; using its EOS token %r as the pad token",
                       path, no_pad, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok


# tokenizer_class values that mean "the tokenizer is tokenizer.json, no model-specific class".
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declares_plain_tokenizer_json(path: str) -> bool:
    """Whether `path` holds a tokenizer.json and a tokenizer_config.json whose tokenizer_class
    is a plain one (what `write_tiny_model` saves)."""
    config, tokenizer = Path(path) / "tokenizer_config.json", Path(path) / "tokenizer.json"
    if not (config.is_file() and tokenizer.is_file()):
        return False
    try:
        declared = json.loads(config.read_text()).get("tokenizer_class")
    except (ValueError, OSError, AttributeError):
        return False
    return declared in PLAIN_TOKENIZER_CLASSES


def plain_config(config):
    """A copy of a model config without `quantization_config`. Loading a GGUF file records one
    (quant_method gguf), yet the weights dagrl trains and saves are plain dense tensors: a
    checkpoint or export that kept it would make loaders look for the GGUF file."""
    config = copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


@contextmanager
def _quiet_gguf_conversion():
    """transformers' GGUF converter draws a tqdm bar of its own, outside the progress-bar switch
    of its logging (`hf_logging.disable_progress_bar`): silence it for one load."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def load_model(path: str, gguf_file: str = "", dtype: str = "float32",
               device: torch.device | str | None = None, attn_implementation: str = "auto",
               ) -> PreTrainedModel:
    """Load a HF causal LM from a local directory (safetensors, or a GGUF file inside it).
    `attn_implementation`: see `dagrl.engines.attention.resolve_attn_implementation`. The
    default device is the host."""
    check_model_dir(path, gguf_file)
    device = host_device() if device is None else device
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    hf_logging.disable_progress_bar()   # one bar per model load is noise in a training log
    with _quiet_gguf_conversion() if gguf_file else nullcontext():
        config = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
        model = causal_lm_class(config).from_pretrained(
            path, local_files_only=True, dtype=DTYPES[dtype],
            attn_implementation=resolve_attn_implementation(attn_implementation, device),
            **kwargs)
    # Dropout would make log-probs of the same tokens differ between the rollout, old-logprob
    # and update passes; RL post-training runs with it off.
    _disable_dropout(model)
    return model.to(device)


def causal_lm_class(config) -> type:
    """The auto class of a config's generating model: an image-text model's (its vision tower
    and language model, e.g. Qwen2.5-VL) or a causal LM's."""
    return AutoModelForImageTextToText if reads_images(config) else AutoModelForCausalLM


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for attr in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, 0.0)


@torch.no_grad()
def cast_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """An inference copy of a plain HF model with its parameters in `dtype`, built from the model
    itself (no second load from disk): the module tree on the meta device, each parameter a cast
    copy (tied ones stay tied), the buffers (rotary frequencies) shared and left in float32.
    The bfloat16 rollout copy of mixed precision (engines/precision.py)."""
    with torch.device("meta"):
        copy = type(model)(model.config)
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in params:
            params[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True),
                                               requires_grad=False)
        module, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(module), leaf, params[id(p)])
    for name, buffer in model.named_buffers(remove_duplicate=False):
        module, _, leaf = name.rpartition(".")
        copy.get_submodule(module)._buffers[leaf] = buffer
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"cast copy: no value for {left[:4]}")
    copy.config.dtype = dtype
    return copy.eval()
