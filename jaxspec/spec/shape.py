"""The shape of a step's verify tree, decided once per plan: a root alone (plain decoding), a
chain (topk = 1 with nothing grafted: a static specialization with no top_k / sort / gather,
docs/architecture.md#a-chain-compiles-no-tree) or a tree (topk > 1, or a hybrid's grafted n-gram
branch).

Everything that differs between them lives here, so the step and the draft loops never test
``topk``: the draft attention mask, organizing drafted candidates, building the verify tree
(from recurrent levels, or from one block forward's candidates), its verify mask, acceptance
(greedy and sampled) and compaction of the accepted path.

Glossary: B rows, K topk, S num_steps, n num_draft_tokens, A = S + 1 (``SpecConfig.max_accept``:
more when a grafted n-gram branch is deeper), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.spec import tree as tree_lib
from jaxspec.spec.compact import compact_pool, gather_to_front
from jaxspec.spec.plan import KEY_COINS, KEY_FINAL, Plan, StepRows, sub_keys
from jaxspec.spec.verify import verify_chain_greedy, verify_chain_rejection, verify_tree_greedy, verify_tree_target_only
from jaxspec.kvcache.layout import draft_scratch_cells
from jaxspec.sampling.distributions import pick_tokens, target_probs, uniforms


def _target_p(plan: Plan, rows: StepRows, logits: jax.Array) -> jax.Array:  # f32[B, n, V]
    return target_probs(logits, rows.sampling.broadcast(logits.shape[:-1]), plan.filtering)


class Root:
    """No draft: the tree is the root alone, one target forward per token."""

    @staticmethod
    def build(bonus: jax.Array, levels, plan: Plan) -> tree_lib.Tree:
        B = bonus.shape[0]
        zeros = jnp.zeros((B, 1), jnp.int32)
        return tree_lib.Tree(tokens=bonus[:, None], depth=zeros, parent=zeros - 1, mask=jnp.ones((B, 1, 1), bool),
                             retrieve_index=jnp.arange(B, dtype=jnp.int32)[:, None], next_token=zeros - 1,
                             next_sibling=zeros - 1)

    @staticmethod
    def verify_mask(tree):
        return None  # a causal block of one row

    @staticmethod
    def accept(plan: Plan, rows: StepRows, tree, logits, q_all, limit=None):
        B = logits.shape[0]
        # The uniform a chain or tree draws its last token with (KEY_FINAL): a row that verifies
        # its root alone draws the same token whether the step verified more for another row.
        predict = pick_tokens(logits[:, 0], rows.sampling, sub_keys(rows.keys, KEY_FINAL), plan.greedy_only,
                              plan.filtering)[:, None]
        return jnp.zeros((B, 1), jnp.int32), jnp.ones((B,), jnp.int32), predict

    @staticmethod
    def compact(plan, tpool, page_table, rows, accept_index, accept_lens, predict, feature):
        return tpool, predict, feature


class Chain:
    """topk = 1: parents and indices are constants, tokens a concatenation, the verify block
    causal, the accepted path a prefix (no top_k / sort / gather, no KV move)."""

    @staticmethod
    def draft_mask(ancestors, parent_row, step: int, num_steps: int):
        B = ancestors.shape[0]
        _, level = draft_scratch_cells(1, num_steps)  # the step each scratch column holds (the layout helper's)
        mask = jnp.asarray(np.broadcast_to(level <= step, (B, 1, num_steps)))
        return mask, ancestors

    @staticmethod
    def build(bonus: jax.Array, levels, plan: Plan) -> tree_lib.Tree:
        _, _, draft_tokens = tree_lib.organize_chain(levels)
        return tree_lib.chain_tree(bonus, draft_tokens)

    @staticmethod
    def block_width(plan: Plan) -> int:
        return 1

    @staticmethod
    def build_block(bonus: jax.Array, tokens: jax.Array, probs: jax.Array, plan: Plan) -> tree_lib.Tree:
        """A block draft's chain: its best token at every position (tokens i32[B, S, 1])."""
        return tree_lib.chain_tree(bonus, tokens[:, :, 0])

    @staticmethod
    def verify_mask(tree):
        return None  # chains verify with a causal block

    @staticmethod
    def accept(plan: Plan, rows: StepRows, tree, logits, q_all, limit=None):
        """limit: i32[B] nodes each row proposed (None: all); see ``jaxspec.spec.verify``."""
        if plan.greedy_only:
            return verify_chain_greedy(tree.tokens, jnp.argmax(logits, axis=-1).astype(jnp.int32), limit)
        p = _target_p(plan, rows, logits)
        coins = uniforms(sub_keys(rows.keys, KEY_COINS), (plan.num_verify,))  # [B, n]
        coin_final = uniforms(sub_keys(rows.keys, KEY_FINAL))  # [B]
        if plan.draft_samples:
            drafted = tree.tokens.shape[1] - 1  # num_steps, or fewer when a prefix is verified
            return verify_chain_rejection(tree.tokens, q_all, p, coins[:, :drafted], coin_final, limit)
        return _target_only(plan, tree, p, coins, coin_final, limit)

    @staticmethod
    def compact(plan, tpool, page_table, rows, accept_index, accept_lens, predict, feature):
        return tpool, predict, feature  # the accepted nodes are already at the front


class Tree:
    """topk > 1: SGLang's dynamic tree (top n-1 of the drafted candidates), a tree verify
    mask, a tree walk, and the accepted path compacted to the front (``jaxspec.spec.compact``)."""

    @staticmethod
    def draft_mask(ancestors, parent_row, step: int, num_steps: int):
        B, K, S = ancestors.shape
        if step > 0:
            ancestors = jnp.take_along_axis(ancestors, parent_row[:, :, None], axis=1)
        ancestors = ancestors.at[:, :, step].set(jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)))
        return draft_ancestor_mask(ancestors, step, num_steps), ancestors

    @staticmethod
    def build(bonus: jax.Array, levels, plan: Plan) -> tree_lib.Tree:
        spec = plan.spec
        parent_list, top_index, draft_tokens = tree_lib.organize_draft_results(levels, spec.num_draft_tokens)
        return tree_lib.build_tree(bonus, parent_list, top_index, draft_tokens, spec.topk, spec.num_steps)

    @staticmethod
    def block_width(plan: Plan) -> int:
        return plan.spec.topk

    @staticmethod
    def build_block(bonus: jax.Array, tokens: jax.Array, probs: jax.Array, plan: Plan) -> tree_lib.Tree:
        """A block draft's tree: the chain plus ``topk - 1`` alternatives per position
        (tokens, probs [B, S, topk], best first), the best ``n - 1`` by path score."""
        return tree_lib.block_tree(bonus, tokens, probs, plan.spec.num_draft_tokens)

    @staticmethod
    def verify_mask(tree):
        return tree.mask

    @staticmethod
    def accept(plan: Plan, rows: StepRows, tree, logits, q_all, limit=None):
        """limit: i32[B] nodes each row proposed (None: all); see ``jaxspec.spec.verify``."""
        if plan.greedy_only:
            return verify_tree_greedy(tree, jnp.argmax(logits, axis=-1).astype(jnp.int32), plan.spec.depth, limit)
        coins = uniforms(sub_keys(rows.keys, KEY_COINS), (plan.num_verify,))
        coin_final = uniforms(sub_keys(rows.keys, KEY_FINAL))
        return _target_only(plan, tree, _target_p(plan, rows, logits), coins, coin_final, limit)

    @staticmethod
    def compact(plan, tpool, page_table, rows, accept_index, accept_lens, predict, feature):
        tpool = compact_pool(tpool, page_table, rows.seq_lens, accept_index, accept_lens, rows.active,
                             implementation=plan.implementation,
                             tensor_parallel=getattr(plan.target, "tensor_parallel", 1))
        predict = gather_to_front(predict, accept_index)  # [B, A]
        feature = None if feature is None else gather_to_front(feature, accept_index)
        return tpool, predict, feature


def _target_only(plan: Plan, tree, p, coins, coin_final, limit=None):
    spec = plan.spec
    return verify_tree_target_only(tree, p, coins, coin_final, spec.depth, spec.accept_threshold_single,
                                   spec.accept_threshold_acc, limit)


def draft_ancestor_mask(
    ancestors: jax.Array,  # i32[B, K, S] branch of each row's ancestor at every step
    step: int,
    num_steps: int,
) -> jax.Array:  # bool[B, K, K*S]: each scratch column visible to each row
    """Row k at ``step`` sees the scratch column of branch j, step i iff i <= step and its step-i
    ancestor is branch j (exact tree attention for the draft). Which (j, i) each column holds comes
    from the layout helper (``draft_scratch_cells``; column ``j*S + i``), as the writes' positions do."""
    B, K, S = ancestors.shape
    branch, level = draft_scratch_cells(K, num_steps)  # i32[K*S] each: the (j, i) of every column
    on_path = ancestors[:, :, level] == jnp.asarray(branch)[None, None, :]  # [B, K, K*S]
    return on_path & jnp.asarray(level <= step)[None, None, :]


def shape_for(plan: Plan):
    """The one place that decides root / chain / tree."""
    if plan.spec is None:
        return Root
    return Chain if plan.spec.is_chain else Tree  # a chain with a grafted n-gram branch is a tree
