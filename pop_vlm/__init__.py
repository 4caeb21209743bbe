"""pop-vlm: vision-language models that answer faster by Prefill-Only Pruning (POP)."""
from .batch import BatchScheduler
from .config import MODES, PopConfig
from .importance import LayerImportance
from .loading import answer, load
from .pipeline import Pipeline, PreparedPrompt
from .results import Answer, Timings
from .sampling import SamplingParams

__all__ = ["MODES", "Answer", "BatchScheduler", "LayerImportance", "Pipeline", "PopConfig", "PreparedPrompt", "SamplingParams", "Timings", "answer", "load"]
__version__ = "0.1.0"
