"""Training: drafts for a target (``jaxspec train-draft``: EAGLE-3 heads, DFlash and DSpark block
drafts) and small LMs (the demo target).

    cli            ``jaxspec train-draft``: arguments, corpus split, the run
    draft_train    the draft trainer: frozen target features, reports, checkpoints, export
    ttt            EAGLE-3's training-time test: the head unrolled over simulated draft steps
    dflash_method  DFlash: block-parallel prediction from random anchors
    dspark_method  DSpark: DFlash plus the Markov and confidence heads' losses
    forward        dense causal forward of a Llama-family target (features for training)
    lm             next-token LM training
    corpus         file listing, held-out split by path hash, tokenization, windows
    vocab          draft vocabulary (d2t / t2d) from token frequencies
    optim          AdamW + warmup / cosine schedule
    state          training checkpoints (arrays + metadata, written atomically)

Checkpoints are exported with the name tables of ``jaxspec.model.checkpoints``.
"""
