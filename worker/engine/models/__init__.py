"""Our own model code: attention runs through the engine's paged KV path (see attention/)."""

from tokenmill.engine.models.decoder import DecoderForCausalLM, DecoderLayer

# ModelConfig.architecture -> model class. The three share one decoder; flags in ModelConfig differ.
MODEL_CLASSES = {
    "llama": DecoderForCausalLM,
    "qwen2": DecoderForCausalLM,
    "qwen3": DecoderForCausalLM,
}

__all__ = ["MODEL_CLASSES", "DecoderForCausalLM", "DecoderLayer"]
