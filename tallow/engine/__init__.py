"""The engine: sequences, KV cache, scheduler, runner, sampler, core loop, and the engine thread's
bridge to asyncio (async_engine.py)."""
