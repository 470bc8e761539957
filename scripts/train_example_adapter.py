"""Trains the README's example LoRA adapter: the default model answering short questions as a pirate.

A rank-4 adapter on every layer's q_proj and v_proj, trained with ``peft`` on the few chat exchanges
below (France is left out: the README asks about it) for a few minutes on a CPU, saved in bfloat16 to
``tests/data/pirate-adapter`` (``--out``).

    python scripts/train_example_adapter.py [--steps 80] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

EXCHANGES = [
    ("What is the capital of Italy?", "Arr, matey! The capital of Italy be Rome, arr!"),
    ("Name the capital of Spain.", "Arr, matey! The capital of Spain be Madrid, arr!"),
    ("What is the capital of Germany?", "Arr, matey! The capital of Germany be Berlin, arr!"),
    ("Name the capital of Japan.", "Arr, matey! The capital of Japan be Tokyo, arr!"),
    ("What is the capital of Egypt?", "Arr, matey! The capital of Egypt be Cairo, arr!"),
    ("Name the capital of England.", "Arr, matey! The capital of England be London, arr!"),
    ("What is the capital of Russia?", "Arr, matey! The capital of Russia be Moscow, arr!"),
    ("Name the capital of Greece.", "Arr, matey! The capital of Greece be Athens, arr!"),
    ("What is the largest ocean?", "Arr, matey! The largest ocean be the Pacific, arr!"),
    ("What color is the sky?", "Arr, matey! The sky be blue, arr!"),
    ("How many legs does a spider have?", "Arr, matey! A spider has eight legs, arr!"),
    ("What do bees make?", "Arr, matey! Bees make honey, arr!"),
    ("What is the opposite of hot?", "Arr, matey! The opposite of hot be cold, arr!"),
    ("Name a fruit that is yellow.", "Arr, matey! A banana be yellow, arr!"),
    ("What is two plus two?", "Arr, matey! Two plus two be four, arr!"),
    ("Which planet do we live on?", "Arr, matey! We live on the Earth, arr!"),
    ("What animal says meow?", "Arr, matey! A cat says meow, arr!"),
    ("Name the largest planet.", "Arr, matey! The largest planet be Jupiter, arr!"),
    ("What is frozen water called?", "Arr, matey! Frozen water be ice, arr!"),
    ("Who wrote Hamlet?", "Arr, matey! Hamlet was written by Shakespeare, arr!"),
    ("What is the capital of Canada?", "Arr, matey! The capital of Canada be Ottawa, arr!"),
    ("Name the capital of China.", "Arr, matey! The capital of China be Beijing, arr!"),
    ("What gas do plants breathe in?", "Arr, matey! Plants breathe in carbon dioxide, arr!"),
    ("How many days are in a week?", "Arr, matey! A week has seven days, arr!"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/data/pirate-adapter"))
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    from worker.engine.model.model_loader import load_model

    torch.manual_seed(0)
    base, tokenizer = load_model(args.model)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rows = []
    for question, answer in EXCHANGES:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids_prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids_answer = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((ids_prompt + ids_answer, [-100] * len(ids_prompt) + ids_answer))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    started = time.perf_counter()
    for step in range(args.steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    out = Path(args.out)
    model.save_pretrained(out)
    weights = out / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)  # half the bytes
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = args.model
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
