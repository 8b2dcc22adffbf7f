"""dllm.full: full-attention diffusion LMs (LLaDA, Dream): config and family detection, the bidirectional
model in the official layouts, streaming load / export, block-wise decoding with traces (exact and
prefix-cache modes) and the full-attention trace replay. See docs/INTERFACES.md (dllm.full).

    from dllm.full import FullAttentionLM, FullAttentionConfig, detect_family, load_full_pretrained
"""

from dllm.full.config import FullAttentionConfig, detect_family, folder_family, load_full_config
from dllm.full.load import load_full_pretrained, save_full_pretrained
from dllm.full.model import FullAttentionLM

__all__ = ["FullAttentionConfig", "FullAttentionLM", "detect_family", "folder_family", "load_full_config",
           "load_full_pretrained", "save_full_pretrained"]
