"""The models: the registry keyed by architecture name, GPT, Llama, the optimizer and
precision they train with, and loading Hugging Face weights."""
