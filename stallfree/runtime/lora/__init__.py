"""LoRA adapters: PEFT checkpoints read and checked, the registry of names, host weights and
device slots (the model side is model/lora.py)."""
