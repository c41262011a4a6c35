"""Our model behind transformers' interface: what an exported directory's modeling_kimi.py holds
(kimi.interop.remote copies this file and the kimi modules it needs, their imports made relative).

KimiForCausalLM wraps kimi.model.KimiModel unchanged (its tensors are ours under ``model.``); its forward
is our forward, and with a cache our incremental decoding: KDA's recurrent state and conv tails, MLA's
latents (kimi.model.cache), carried between generate()'s steps by KimiCache.
"""

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from kimi.interop.configuration_kimi import KimiConfig
from kimi.model.cache import InferenceCache
from kimi.model.config import ModelConfig
from kimi.model.transformer import KimiModel

# transformers 5 names the cache `cache`, earlier versions `past_key_values`
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class KimiCache(InferenceCache):
    """Our decoding state with what transformers' generate() asks of a cache. Nothing here can be cropped
    back or compiled. ``is_linear`` is false for every layer, KDA's too: the whole state counts the tokens it
    has seen (seen_tokens), so generate() may always cut a prompt that repeats them (a cache passed back in)
    by get_seq_length."""

    is_compileable = False
    is_croppable = False

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: each row of every layer's state becomes the state of the beam it continues."""

        def pick(x):
            if isinstance(x, torch.Tensor):
                return x.index_select(0, beam_idx.to(x.device))
            return {k: pick(v) for k, v in x.items()} if isinstance(x, dict) else x

        for i, layer in enumerate(self.layers):
            if dataclasses.is_dataclass(layer):
                for f in dataclasses.fields(layer):
                    setattr(layer, f.name, pick(getattr(layer, f.name)))
            else:
                self.layers[i] = pick(layer)


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _is_stateful = True  # KDA's state cannot step back: no assisted decoding (beam search reorders it)
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # when tie_word_embeddings

    def _init_weights(self, module):
        """The tensors the weights file did not fill: our MoE layers' running statistics (non-persistent
        buffers) start at zero, as KimiModel.init_buffers starts them; a parameter as our init rules start
        it (KimiModel.init_parameter)."""
        model = getattr(self, "model", None)
        if model is None:  # called before our model exists: nothing of ours to fill yet
            return
        names = self.__dict__.setdefault("_module_names", {id(m): n for n, m in model.named_modules()})
        for buffer in module.buffers(recurse=False):
            if not getattr(buffer, "_is_hf_initialized", False):
                buffer.zero_()
        for name, param in module.named_parameters(recurse=False):
            if id(module) in names and not getattr(param, "_is_hf_initialized", False):
                with torch.no_grad():
                    model.init_parameter(".".join(filter(None, (names[id(module)], name))), param)


class KimiForCausalLM(KimiPreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiConfig):
        super().__init__(config)
        self.model = KimiModel(ModelConfig(**config.kimi_model))
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its own KimiCache: generate() must not hand it a DynamicCache

    def new_cache(self) -> KimiCache:
        return KimiCache(self.model.new_cache().layers)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: KimiCache | None = None, past_key_values: KimiCache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                return_dict: bool | None = None, **kwargs):
        """Logits [B, T, vocab] of input_ids [B, T]; with a cache (or use_cache, which starts one) the rows
        continue the sequences it holds. labels: the next-token loss over positions 1.. (-100 ignored).
        Rows run unpadded: an attention_mask with a zero is refused."""
        if input_ids is None:
            raise ValueError("this model takes input_ids (token ids), not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this model runs rows without padding: pass rows of equal length (no zeros in "
                             "attention_mask), or one sequence per call")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        logits = self.model(input_ids, cache=cache)
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float().flatten(0, 1)
            loss = F.cross_entropy(shifted, labels[:, 1:].flatten(), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
        return out if return_dict is not False else out.to_tuple()
