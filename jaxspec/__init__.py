"""jaxspec: lossless speculative decoding (EAGLE, EAGLE-3, MTP) in JAX with Pallas kernels."""

from jaxspec.config import EngineConfig as EngineConfig
from jaxspec.config import SamplingParams as SamplingParams
from jaxspec.config import SpecConfig as SpecConfig
from jaxspec.engine.allocator import KVCacheExhausted as KVCacheExhausted
from jaxspec.generate import GenerateOutput as GenerateOutput
from jaxspec.generate import generate as generate
from jaxspec.model.draft import DraftModel as DraftModel
from jaxspec.model.draft import load_draft as load_draft
from jaxspec.model.draft import standalone_draft as standalone_draft
from jaxspec.model.loader import Model as Model
from jaxspec.model.loader import load_model as load_model
from jaxspec.model.tokenizer import load_tokenizer as load_tokenizer

__version__ = "0.1.0"
