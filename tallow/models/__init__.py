"""Model sources (default wheel, .gguf, HF folder, dummy:<preset>, a registry for more), the
engine's model code, its tensor-parallel shard layout, and EngineModel (the model loaded as an
EngineConfig says)."""
