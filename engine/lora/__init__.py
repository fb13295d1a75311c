"""Multi-LoRA serving: PEFT adapters on one base model, rows of different adapters in one step."""
