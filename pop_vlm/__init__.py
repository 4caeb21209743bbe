"""pop-vlm: vision-language models that answer faster by Prefill-Only Pruning (POP)."""
from .config import MODES, PopConfig
from .generate import Answer, SamplingParams, Timings
from .importance import LayerImportance
from .pipeline import Pipeline, PreparedPrompt, answer, load

__all__ = ["MODES", "Answer", "LayerImportance", "Pipeline", "PopConfig", "PreparedPrompt", "SamplingParams", "Timings", "answer", "load"]
__version__ = "0.1.0"
