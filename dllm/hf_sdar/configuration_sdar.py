"""SDAR configuration for transformers (`trust_remote_code`): a Qwen3 config plus the
block-diffusion fields `block_size` and `mask_token_id`. Shipped by dlrl into exports."""

from transformers import PretrainedConfig


class SDARConfig(PretrainedConfig):
    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                 max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=False,
                 tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                 attention_dropout=0.0, block_size=4, mask_token_id=151669, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


__all__ = ["SDARConfig"]
