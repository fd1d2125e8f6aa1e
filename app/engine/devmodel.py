"""The tiny development model: a random-weight Llama built locally, never downloaded.

It exists so the whole stack (vLLM engines, KV transfer, handoffs) runs on a
laptop-class CPU. Its weights are random, so its text is nonsense, but greedy
decoding is deterministic, which is all the correctness contract needs.

Choices that matter:
- head_dim 64: vLLM's CPU attention backend rejects smaller heads.
- A BPE vocabulary over printable ASCII with SentencePiece-style word
  boundaries (Metaspace), not byte-level: every token decodes to visible text,
  so streamed output is readable (byte-level tokens often decode to partial
  UTF-8, i.e. empty strings).
- The EOS row of the output projection is zeroed, so greedy decoding never
  stops early by chance: outputs run to max_tokens or a stop string.
- float32 weights: wide logit gaps keep greedy choices stable across batch
  shapes, which the token-exact tests between pipelines rely on.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path

import typer

#: Bump when anything below changes what is built; it names the cache folder.
DEVMODEL_VERSION = 3
SEED = 1234
VOCAB_SIZE = 512
HIDDEN_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
MAX_POSITIONS = 16384

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Tools go in a system turn and an assistant's calls between <tool_call> markers (Hermes'
# shape), so agents' conversations with tool turns render as one growing prefix.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    '<tool_call>{"name": {{ call["function"]["name"] | tojson }}, "arguments": {{ call["function"]["arguments"] }}}</tool_call>'
    "{% endfor %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_CORPUS = """
the model serves requests across two datacenters with a slow network between them
prefill computes the prompt cache and decode produces one token at a time
a relay decoder starts at once while the cache crosses the wide area network
the main decoder keeps the cache of past turns so only new blocks travel
agents watch the metrics and tune the thresholds when latency grows
an operator asks why the tail latency rose and the agent answers with figures
tool calls return long results and the next turn sends the whole context again
hello world this is a small test of streaming tokens through the service
please summarize the log file and list every error with its time and cause
the quick brown fox jumps over the lazy dog while the cluster scales out
user assistant system function result error warning info debug trace
one two three four five six seven eight nine ten hundred thousand million
read write open close start stop scale route cache block token request reply
json yaml python shell query table column value key time date size rate
""".strip()


def default_cache_dir() -> Path:
    root = os.environ.get("PDD_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdd-serve")
    return Path(root)


def devmodel_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"devmodel-v{DEVMODEL_VERSION}"


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    # Llama's decoder, which Metaspace's equals on this vocabulary: grammar backends read it to
    # know that "▁" is a space (as Metaspace, xgrammar took it for a letter and no token spelled one).
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=list(string.printable.strip()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def build_devmodel(target: Path) -> Path:
    """Build the model into ``target`` (atomically: a half-built folder never shows)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_build_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "pdd_devmodel.json").write_text(json.dumps({"version": DEVMODEL_VERSION, "seed": SEED, "fingerprint": _fingerprint(tmp)}))
    if target.exists():  # another process won the race; keep its copy
        _remove_tree(tmp)
    else:
        tmp.rename(target)
    return target


def _fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _remove_tree(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def ensure_devmodel(cache_dir: Path | None = None) -> Path:
    """Return the dev model's folder, building it first when missing."""
    target = devmodel_dir(cache_dir)
    if not (target / "pdd_devmodel.json").exists():
        build_devmodel(target)
    return target


def ensure_llama8b_shape(cache_dir: Path | None = None) -> Path:
    """A Llama-3-8B-shaped model folder without weights (vLLM `load_format: dummy`), with
    the dev tokenizer: GPU benchmarks get real 8B compute and KV sizes, and output the
    conductor can still detokenize."""
    import shutil

    from transformers import LlamaConfig

    dev = ensure_devmodel(cache_dir)
    target = (cache_dir or default_cache_dir()) / f"llama8b-shape-v{DEVMODEL_VERSION}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (dev / name).exists():
            shutil.copy(dev / name, tmp / name)
    vocab = json.loads((dev / "config.json").read_text())["vocab_size"]
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        dtype="bfloat16",
        tie_word_embeddings=False,
    ).save_pretrained(tmp)
    if target.exists():
        _remove_tree(tmp)
    else:
        tmp.rename(target)
    return target


def resolve_model_source(source: str) -> str:
    """What vLLM and the tokenizer load for a `model.source` config value."""
    if source == "devmodel":
        return str(ensure_devmodel())
    return os.path.expanduser(source) if source.startswith(("~", ".", "/")) else source


cli = typer.Typer(help="Build the tiny local development model.")


@cli.command()
def main(cache_dir: Path | None = typer.Option(None, help="Cache folder (default: ~/.cache/pdd-serve).")):
    """Build the dev model when missing and print its folder."""
    typer.echo(ensure_devmodel(cache_dir))


if __name__ == "__main__":
    cli()
