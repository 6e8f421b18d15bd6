"""Model sources (default wheel, .gguf, HF folder, dummy:<preset>) and the engine's model code."""
