"""A standalone draft: any supported LM with the target's vocabulary, run token by token with
its own KV pool of its own kind (MHA or MLA)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxspec.kvcache.recurrent import HybridPool
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel
from jaxspec.model.targets import KVLayout, Model, create_target_pool, kv_layout, kv_window, target_forward, target_logits


@dataclasses.dataclass(frozen=True)
class StandaloneDraft(Draft):
    """Row ``p`` consumes the token at ``p`` (``pos_offset`` 1); it reads no target feature."""

    model: Any  # a target config (LlamaConfig, DeepseekConfig)
    kind: ClassVar[str] = "standalone"
    pos_offset: ClassVar[int] = 1

    @property
    def feature(self) -> None:
        return None

    @property
    def kv_window(self) -> int | None:
        return kv_window(self.model)

    @property
    def kv_layout(self) -> KVLayout:
        return kv_layout(self.model)

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1, entry_pages=None):
        return create_target_pool(self.model, num_pages=num_pages, page_size=page_size, dtype=dtype,
                                  window_pages=window_pages, rows=rows, entry_pages=entry_pages)

    def open_scratch(self, pool, width: int):
        """A hybrid LM drafting a tree keeps its scratch nodes' pending state beside their KV."""
        if not isinstance(pool, HybridPool):
            return pool
        g = self.model.gdn
        return pool.with_scratch(width, g.num_k_heads, g.conv_dim)

    def close_scratch(self, pool):
        return dataclasses.replace(pool, scratch=None) if isinstance(pool, HybridPool) else pool

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        out = target_forward(self.model, params, tokens, positions, pool, attn, implementation=implementation)
        return out.hidden, out.hidden, out.pool

    def logits(self, params, logit_in):
        return target_logits(self.model, params, logit_in)


def standalone_draft(model: Model) -> DraftModel:
    """Uses an already-loaded LM (e.g. a smaller model of the same family, or the target
    itself in tests) as a standalone draft."""
    return DraftModel(config=StandaloneDraft(model=model.config), params=model.params, path=model.path,
                      mesh=model.mesh)
