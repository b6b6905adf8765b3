"""Training: EAGLE-3 draft heads (``jaxspec train-draft``) and small LMs (the demo target).

    forward      dense causal forward of a Llama-family target (features for training)
    ttt          EAGLE-3 training-time test: the head unrolled over simulated draft steps
    draft_train  the head trainer (reports, checkpoints, export)
    lm           next-token LM training
    corpus       file listing, held-out split by path hash, tokenization, windows
    vocab        draft vocabulary (d2t / t2d) from token frequencies
    export       HF Llama and EAGLE-3 checkpoint writers
    optim        AdamW + warmup/cosine schedule; state: training checkpoints
"""
