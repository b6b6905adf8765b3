"""DSpark block drafts: a DFlash backbone plus a Markov head and a confidence head
(checkpoint layout and config parsing: ``jaxspec.model.checkpoints.speculators``; DeepSeek's own layout for
DeepSeek-V4, whose backbone is V4 blocks, subclasses this: ``jaxspec.model.drafts.deepseek_v4_dspark``).

The backbone is DFlash's (``jaxspec.model.drafts.dflash``): one non-causal block forward over
``[anchor, mask, ...]`` reading the target's features as context. DSpark then drafts the block
left to right, each slot conditioned on the token actually chosen at the slot before it:

    logits_k = head(h_k) + markov_k         h_k: the block's normed output at slot k
    markov_k = W2 z_k                       z_k from e_k = W1[prev_k] (prev_0 = the anchor):
        vanilla   z_k = e_k
        gated     z_k = sigmoid(gate([h_k, e_k])) * e_k
        rnn       s_{k+1} = g * s_k + (1 - g) * tanh(c),  z_k = tanh(o),
                  [g_raw, c, o] = joint([s_k, e_k, h_k]),  g = sigmoid(g_raw),  s_0 = 0
    confidence_k = conf([h_k, e_k]) (or conf(h_k)): one logit; its sigmoid is the predicted
        probability that slot k's token is accepted given the ones before it

``sample_from_anchor`` (the DSpark default) makes every slot draft: slot k predicts the token
after position start + k, so a chain of N tokens is a block of N slots, the anchor's included.
Without it the anchor slot drafts nothing (DFlash's layout): N tokens need N + 1 slots. Either
way the recurrent state of the ``rnn`` head starts at zero at the block's first slot.

A draft with its own reduced vocabulary (``draft_vocab_size`` < the target's) has its own head
and ``d2t`` (``params["hot_ids"]``: the target id of each draft token); its logits are widened to
the target's vocabulary (-inf elsewhere) before anything chooses from them.

Params (linear weights ``[in, out]``), besides DFlash's (``fc``, ``hidden_norm``, ``layers/``,
``norm``, the target's ``embed`` and ``lm_head``):
    markov/w1 [V, r]; markov/w2 [r, Vd]; markov/gate_w [H + r, r], gate_b [r] (gated);
    markov/joint_w [2r + H, 3r], joint_b [3r] (rnn); confidence/w [H (+ r), 1], confidence/b [1];
    own_head [H, Vd] and hot_ids i32[Vd] (reduced vocabulary only)

Glossary: B rows, Q block slots, S proposals, H width, r Markov rank, V target vocabulary (W its
logits width: padded on a mesh), Vd draft vocabulary, k candidates per slot.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from jaxspec.model.drafts.base import DraftModel, check_block_tree
from jaxspec.model.drafts.dflash import DFlashConfig, DFlashDraft, dflash_logits
from jaxspec.sampling.grammar_masks import Grammar
from jaxspec.model.layers import mask_padded_vocab
from jaxspec.sampling.distributions import sample_with_uniform, target_probs

MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSparkConfig(DFlashConfig):
    """Static shape of a DSpark draft: DFlash's plus its heads.

    sample_from_anchor: every block slot drafts (the anchor's too); else the anchor slot does not.
    num_speculative_tokens: the chain depth it was trained for (``speculators_config``).
    markov_rank: r (0: no Markov head). markov_head_type: one of ``MARKOV_HEADS``.
    confidence_head: it has one; confidence_with_markov: its input is [h, W1[prev]].
    draft_vocab_size: Vd (== vocab_size: it uses the target's head).
    """

    sample_from_anchor: bool = True
    num_speculative_tokens: int = 0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    draft_vocab_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not self.draft_vocab_size:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        if self.markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"DSpark markov_head_type {self.markov_head_type!r} is not one of {MARKOV_HEADS}")
        if self.confidence_with_markov and not self.markov_rank:
            raise ValueError("DSpark confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        if not self.num_speculative_tokens:
            object.__setattr__(self, "num_speculative_tokens", self.max_proposals)

    @property
    def max_proposals(self) -> int:
        """Most draft tokens one block can hold."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def own_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


def markov_bias(params: dict, cfg: DSparkConfig, prev: jax.Array, h: jax.Array, state: jax.Array):
    """One slot of the Markov head: prev i32[B] the token chosen before it, h [B, H] its hidden,
    state f32[B, r] (rnn). Returns (bias f32[B, Vd], new state, e = W1[prev] [B, r])."""
    m = params["markov"]
    e = m["w1"][prev].astype(jnp.float32)  # [B, r]
    h = h.astype(jnp.float32)
    if cfg.markov_head_type == "vanilla":
        z = e
    elif cfg.markov_head_type == "gated":
        z = jax.nn.sigmoid(jnp.concatenate([h, e], axis=-1) @ m["gate_w"].astype(jnp.float32)
                           + m["gate_b"].astype(jnp.float32)) * e
    else:  # rnn
        x = jnp.concatenate([state, e, h], axis=-1) @ m["joint_w"].astype(jnp.float32) + m["joint_b"].astype(jnp.float32)
        g_raw, c, o = jnp.split(x, 3, axis=-1)  # [B, r] each
        g = jax.nn.sigmoid(g_raw)
        state = g * state + (1.0 - g) * jnp.tanh(c)
        z = jnp.tanh(o)
    if cfg.markov_head_type == "vanilla" and m["w1"].dtype == m["w2"].dtype:
        # z = W1[prev]: the head's product in the weights' dtype (a model in bf16 rounds the bias to
        # bf16 once), reading W2 as stored. In f32 (z @ W2.astype(f32)) XLA:GPU made an f32 copy of W2
        # every step (131 MB at a 128k vocabulary), which every slot then read at twice the bytes.
        return (m["w1"][prev] @ m["w2"]).astype(jnp.float32), state, e
    return z @ m["w2"].astype(jnp.float32), state, e


def confidence_logits(params: dict, cfg: DSparkConfig, hidden: jax.Array, prev: jax.Array) -> jax.Array:
    """hidden [B, S, H] at the drafting slots, prev i32[B, S] the token before each -> f32[B, S]."""
    x = hidden.astype(jnp.float32)
    if cfg.confidence_with_markov:
        x = jnp.concatenate([x, params["markov"]["w1"][prev].astype(jnp.float32)], axis=-1)
    c = params["confidence"]
    return (x @ c["w"].astype(jnp.float32) + c["b"].astype(jnp.float32))[..., 0]


@dataclasses.dataclass(frozen=True)
class DSparkDraft(DFlashDraft):
    """A DSpark block draft (``proposer`` "block"): DFlash's forwards, a left-to-right choice
    through the Markov head, and the confidence head's per-slot acceptance estimates."""

    model: DSparkConfig

    @property
    def kind(self) -> str:  # a speculators DFlash that needs this class (anchor drafting, own vocabulary)
        return "dspark" if self.model.markov_rank or self.model.confidence_head else "dflash"

    @property
    def has_confidence_head(self) -> bool:
        return self.model.confidence_head

    def block_length(self, num_steps: int) -> int:
        """Q: block slots for S = ``num_steps`` proposals."""
        return num_steps + self.model.first_draft_slot

    def proposal_hidden(self, hidden: jax.Array, seed) -> jax.Array:
        """The whole block [B, Q, H]: the rnn head runs from the block's first slot."""
        del seed
        return hidden

    def check_spec(self, spec) -> None:
        """S proposals must fit the block: ``block_size`` of them with ``sample_from_anchor``, one
        fewer without; a tree hangs ``topk - 1`` alternatives per slot off the greedy path."""
        cfg = self.model
        if spec.num_steps > cfg.max_proposals:
            how = ("sample_from_anchor: every slot drafts" if cfg.sample_from_anchor
                   else "sample_from_anchor false: the anchor slot drafts nothing")
            raise ValueError(
                f"this DSpark draft fills at most {cfg.max_proposals} draft tokens per block (block_size "
                f"{cfg.block_size}, {how}); num_steps={spec.num_steps} asks for more: use num_steps <= "
                f"{cfg.max_proposals} (its chain is SpecConfig.chain({cfg.num_speculative_tokens}))")
        # DFlash's own checks against a block of S + 1 slots do not apply when the anchor drafts.
        super(DFlashDraft, self).check_spec(spec)
        check_block_tree("DSpark", spec)

    def check_fits(self, target_cfg) -> None:
        super().check_fits(target_cfg)
        cfg = self.model
        if cfg.own_vocab and cfg.draft_vocab_size > target_cfg.vocab_size:
            raise ValueError(f"DSpark draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary "
                             f"{target_cfg.vocab_size}")

    # --------------------------------------------------------------------------- logits

    def base_logits(self, params, hidden):  # [..., H] -> f32[..., Vd]
        """The head before the Markov bias: its own (reduced vocabulary) or the target's."""
        if self.model.own_vocab:
            return (hidden @ params["own_head"]).astype(jnp.float32)
        return dflash_logits(params, self.model, hidden)

    def to_target(self, params, logits):  # f32[..., Vd] -> f32[..., W]
        """Draft-vocabulary logits widened to the target's logits width (-inf elsewhere)."""
        width = params["embed"].shape[0]  # the target's vocabulary rows (padded on a mesh)
        if self.model.own_vocab:
            full = jnp.full(logits.shape[:-1] + (width,), -jnp.inf, logits.dtype)
            return full.at[..., params["hot_ids"]].set(logits)
        return mask_padded_vocab(logits, self.model.vocab_size, width)

    def logits(self, params, logit_in):
        return self.to_target(params, self.base_logits(params, logit_in))

    def slot_logits(self, params, hidden, anchor, choose):
        """Drafts the block left to right. hidden [B, Q, H] (the whole block); anchor i32[B];
        ``choose(t, logits f32[B, W]) -> token i32[B]`` picks slot t's token from its
        Markov-corrected logits (over the target's vocabulary).
        Returns (tokens i32[B, S], logits f32[B, S, W])."""
        cfg = self.model
        B, Q, _ = hidden.shape
        base = self.base_logits(params, hidden)  # [B, Q, Vd]
        state = jnp.zeros((B, max(cfg.markov_rank, 1)), jnp.float32)
        prev, toks, outs = anchor, [], []
        for slot in range(Q):
            logits = base[:, slot]
            if cfg.markov_rank:
                bias, state, _ = markov_bias(params, cfg, prev, hidden[:, slot], state)
                # the target's head may be wider (a vocabulary padded for a mesh; -inf there already)
                logits = logits + jnp.pad(bias, ((0, 0), (0, logits.shape[-1] - bias.shape[-1])))
            if slot < cfg.first_draft_slot:
                continue  # the anchor slot without sample_from_anchor: it only advances the rnn state
            logits = self.to_target(params, logits)
            tok = choose(len(toks), logits)
            toks.append(tok)
            outs.append(logits)
            prev = tok
        return jnp.stack(toks, axis=1), jnp.stack(outs, axis=1)

    def confidence(self, params, hidden, anchor, drafted) -> jax.Array:
        """Each drafted slot's predicted acceptance probability given the tokens before it.
        hidden [B, Q, H]; anchor i32[B]; drafted i32[B, S] -> f32[B, S]."""
        h = hidden[:, self.model.first_draft_slot:]
        prev = jnp.concatenate([anchor[:, None], drafted[:, :-1]], axis=1)
        return jax.nn.sigmoid(confidence_logits(params, self.model, h, prev))

    # --------------------------------------------------------------------------- proposals

    def candidates(self, params, hidden, anchor, width: int, grammar: Grammar | None = None):
        """The greedy path through the Markov head (each slot's argmax given the greedy token
        before it) and, at each slot, the next best tokens given the same predecessor.

        hidden: [B, Q, H] the whole block; anchor: i32[B]. Returns (tokens i32[B, S, k],
        probs f32[B, S, k]) with ``tokens[:, :, 0]`` the greedy path. With a ``grammar`` each slot
        proposes only what its state allows after the greedy tokens before it."""
        states = [None if grammar is None or not grammar.enabled else grammar.state]
        masked = []

        def choose(t, logits):
            if states[0] is not None:
                logits = grammar.mask(logits, states[0])
            masked.append(logits)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if states[0] is not None:
                states[0] = grammar.advance(states[0], tok)
            return tok

        path, _ = self.slot_logits(params, hidden, anchor, choose)
        logits = jnp.stack(masked, axis=1)  # [B, S, W]
        probs = jax.nn.softmax(logits, axis=-1)
        if width == 1:
            return path[..., None], jnp.max(probs, axis=-1, keepdims=True)
        p, idx = jax.lax.top_k(probs, width)
        return idx.astype(jnp.int32), p

    def sample_path(self, params, hidden, anchor, sampling, uniform, *, filtering: bool,
                    grammar: Grammar | None = None):
        """Draws each slot's token from the draft's sampling distribution q of its
        Markov-corrected logits given the token drawn before it (each row's temperature /
        top_k / top_p; one-hot argmax for greedy rows; only what a ``grammar`` allows).

        hidden: [B, Q, H]; uniform: f32[B, S]. Returns (tokens i32[B, S], q f32[B, S, W]: the
        distribution each token was drawn from)."""
        states = [None if grammar is None or not grammar.enabled else grammar.state]
        qs = []

        def choose(t, logits):
            if states[0] is not None:
                logits = grammar.mask(logits, states[0])
            q = target_probs(logits, sampling, filtering, min_p=False)
            tok = sample_with_uniform(q, uniform[:, t])
            qs.append(q)
            if states[0] is not None:
                states[0] = grammar.advance(states[0], tok)
            return tok

        drafted, _ = self.slot_logits(params, hidden, anchor, choose)
        return drafted, jnp.stack(qs, axis=1)


def dspark_draft(cfg: DSparkConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps DSpark params (a checkpoint, ``init_dspark_params`` or training) as a draft."""
    return DraftModel(config=DSparkDraft(model=cfg), params=params, path=path)
