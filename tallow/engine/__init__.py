"""The engine: sequences, KV cache, scheduler, runner, sampler, core loop."""
