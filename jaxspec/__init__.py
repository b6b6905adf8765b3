"""jaxspec: lossless speculative decoding for LLMs in JAX with Pallas kernels.

Drafts: EAGLE, EAGLE-3, MTP layers, frozen-KV assistants, block drafts (DFlash, DSpark, P-EAGLE,
PARD), standalone LMs, and model-free n-gram lookup alone or grafted onto a model draft's tree.
This module re-exports the public names; docs/architecture.md describes how the package is built.
"""

from jaxspec.config import EngineConfig as EngineConfig
from jaxspec.config import SamplingParams as SamplingParams
from jaxspec.config import SpecConfig as SpecConfig
from jaxspec.engine.allocator import KVCacheExhausted as KVCacheExhausted
from jaxspec.generate import Engine as Engine
from jaxspec.generate import GenerateOutput as GenerateOutput
from jaxspec.generate import RequestStats as RequestStats
from jaxspec.generate import StreamEvent as StreamEvent
from jaxspec.generate import generate as generate
from jaxspec.generate import generate_stream as generate_stream
from jaxspec.mesh import make_mesh as make_mesh
from jaxspec.model.drafts import DraftModel as DraftModel
from jaxspec.model.drafts import HybridDraft as HybridDraft
from jaxspec.model.drafts import NgramDraft as NgramDraft
from jaxspec.model.drafts import pard_draft as pard_draft
from jaxspec.model.drafts import standalone_draft as standalone_draft
from jaxspec.model.checkpoints.draft_formats import load_draft as load_draft
from jaxspec.model.checkpoints.loader import load_model as load_model
from jaxspec.model.checkpoints.tokenizer import apply_chat_template as apply_chat_template
from jaxspec.model.checkpoints.tokenizer import load_tokenizer as load_tokenizer
from jaxspec.model.targets import Model as Model

__version__ = "0.1.0"
