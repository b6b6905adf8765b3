"""Draft kinds behind one interface (``base.Draft``): EAGLE-1/2, EAGLE-3, DeepSeek MTP, the
frozen-KV assistant, DFlash / DFlash 2 / DSpark block drafts, P-EAGLE heads, PARD parallel drafts,
standalone LMs, model-free n-gram lookup and the hybrid of a model draft with n-gram lookup. Loading
and detection: ``jaxspec.model.checkpoints.draft_formats``."""

from jaxspec.model.drafts.assistant import FrozenKVAssistant as FrozenKVAssistant
from jaxspec.model.drafts.assistant import assistant_draft as assistant_draft
from jaxspec.model.drafts.base import Draft as Draft
from jaxspec.model.drafts.base import DraftContext as DraftContext
from jaxspec.model.drafts.base import DraftModel as DraftModel
from jaxspec.model.drafts.base import DraftSeed as DraftSeed
from jaxspec.model.drafts.dflash import DFlash2Draft as DFlash2Draft
from jaxspec.model.drafts.dflash import DFlashDraft as DFlashDraft
from jaxspec.model.drafts.dflash import dflash_draft as dflash_draft
from jaxspec.model.drafts.eagle import Eagle3Draft as Eagle3Draft
from jaxspec.model.drafts.eagle import EagleDraft as EagleDraft
from jaxspec.model.drafts.eagle import eagle_draft as eagle_draft
from jaxspec.model.drafts.mtp import MtpDraft as MtpDraft
from jaxspec.model.drafts.mtp import mtp_draft as mtp_draft
from jaxspec.model.drafts.ngram import HybridDraft as HybridDraft
from jaxspec.model.drafts.peagle import PEagleDraft as PEagleDraft
from jaxspec.model.drafts.peagle import peagle_draft as peagle_draft
from jaxspec.model.drafts.ngram import NgramDraft as NgramDraft
from jaxspec.model.drafts.pard import PardDraft as PardDraft
from jaxspec.model.drafts.pard import pard_draft as pard_draft
from jaxspec.model.drafts.standalone import StandaloneDraft as StandaloneDraft
from jaxspec.model.drafts.standalone import standalone_draft as standalone_draft
