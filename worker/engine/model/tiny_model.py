"""A tiny random Llama with a real tokenizer, for fast exact tests and for transport
benchmarks where the model must cost next to nothing. Its output is gibberish by design."""

from __future__ import annotations

from pathlib import Path

from worker.engine.model.model_loader import load_tokenizer

TOKENIZER_SOURCE = "smollm2-135m-instruct"


def make_tiny_llama(
    target: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
    head_dim: int | None = None,
) -> Path:
    """Writes a random LlamaForCausalLM plus SmolLM2's tokenizer into ``target``; returns it.
    ``head_dim`` (default hidden_size // num_heads) wider than that gives a model whose KV cache is
    large next to its compute: memory tests fill hundreds of MB of cache in a few seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(target)
    if (target / "config.json").exists():
        return target
    tokenizer = load_tokenizer(TOKENIZER_SOURCE)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        head_dim=head_dim or hidden_size // num_heads,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights give peaked, varied logits, so greedy paths are not all one token.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
