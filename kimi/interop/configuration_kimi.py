"""transformers' configuration of a model exported with its own modeling code (kimi.interop.remote): our
model settings as they are (``kimi_model``, the fields of kimi.config.ModelConfig), beside the few keys
transformers reads itself. It travels into the export as configuration_kimi.py."""

from transformers import PretrainedConfig


class KimiConfig(PretrainedConfig):
    model_type = "kimi_hybrid"

    def __init__(self, kimi_model: dict | None = None, tie_word_embeddings: bool = False, **kwargs):
        self.kimi_model = dict(kimi_model or {})
        # what transformers (and tools reading config.json) look up under their own names
        self.vocab_size = self.kimi_model.get("vocab_size")
        self.hidden_size = self.kimi_model.get("d_model")
        self.num_hidden_layers = self.kimi_model.get("num_layers")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
