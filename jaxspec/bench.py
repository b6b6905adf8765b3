"""``jaxspec bench``: end-to-end decoding throughput, plain vs speculative, over a sweep.

    jaxspec bench                                  # demo pair, full sweep, held-out stdlib prompts
    jaxspec bench --batches 1 --configs plain,chain5,tree4x16 --repeats 5

Every configuration runs once to compile (warm-up), then ``--repeats`` timed runs; the
reported tokens/s is the median. Each run generates exactly ``--max-new-tokens`` tokens per
prompt (stop tokens off), so configurations do equal work. Speedup is tokens/s over plain
decoding at the same batch size, measured in the same process. Writes a JSON file with
every measurement and a PNG plot (speedup and mean accept length per configuration, one
line per batch size).

Configuration names: ``plain``; ``chain<S>`` (topk 1, S draft steps); ``tree<K>x<n>`` (topk K,
n verified tokens, S = ``--tree-steps`` raised to the smallest valid depth when needed);
``tree<K>x<n>s<S>`` (explicit S). Model-free n-gram drafting (``NgramDraft``, ``--ngram-max``,
``--ngram-min``): ``ngram<S>`` (a chain) and ``ngram<K>x<n>[s<S>]`` (a tree of K paths). A hybrid
grafts G n-gram tokens onto the model draft's chain or tree: ``chain<S>+ng<G>`` (n = S + 1 + G),
``tree<K>x<n>[s<S>]+ng<G>`` (n counts the G grafted tokens). A draft with a confidence head
(DSpark) verifies per request only what it predicts will be accepted with ``chain<S>c<threshold>``
(``SpecConfig.confidence_threshold``); the table's ``verified`` column is the mean number of tokens
verified per request per step (the root included) and ``ms/step`` the wall time of one step.

    jaxspec bench --batches 1 --configs plain,chain3,ngram5,ngram2x11,chain3+ng4,tree4x16+ng5
A ``<draft>:`` prefix runs a model-draft configuration with a named draft (``--drafts
name=DIR,...``; the demo names ``eagle3``, ``dflash``, ``dspark`` and ``peagle``), so several drafts
are compared against the same plain baseline in one run:

    jaxspec bench --configs plain,eagle3:chain5,dflash:chain7,dflash:tree4x16s7 --batches 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import sys
import time

DEFAULT_CONFIGS = ("plain,chain1,chain3,chain5,chain7,tree2x8,tree2x16,tree2x32,tree4x8,tree4x16,tree4x32,"
                   "tree8x8,tree8x16,tree8x32")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    name: str
    num_steps: int = 0  # 0: plain decoding
    topk: int = 1
    num_draft_tokens: int = 1
    ngram_tokens: int = 0  # hybrid: n-gram tokens grafted onto the model draft's tree
    drafter: str = "model"  # "model" (the loaded draft), "ngram" (model-free) or "hybrid"
    draft_name: str = ""  # the named draft of a model configuration ("": the default ``--draft``)
    confidence: float | None = None  # a chain verified as far as the draft's confidence head predicts

    @property
    def is_plain(self) -> bool:
        return self.num_steps == 0

    def spec(self):
        from jaxspec.config import SpecConfig

        return None if self.is_plain else SpecConfig(
            num_steps=self.num_steps, topk=self.topk, num_draft_tokens=self.num_draft_tokens,
            ngram_tokens=self.ngram_tokens, confidence_threshold=self.confidence)

    def draft(self, model_drafts, ngram):
        """The draft this configuration runs: None (plain), ``ngram``, a model draft (``model_drafts``:
        one, or a dict by ``draft_name``) or its hybrid with ``ngram``."""
        import jaxspec as js

        if self.is_plain:
            return None
        if self.drafter == "ngram":
            return ngram
        model_draft = model_drafts.get(self.draft_name) if isinstance(model_drafts, dict) else model_drafts
        if model_draft is None:
            raise ValueError(f"bench configuration {self.name!r} needs a model draft (--draft)")
        return js.HybridDraft(model_draft, ngram) if self.drafter == "hybrid" else model_draft


def parse_config(name: str, tree_steps: int = 5) -> BenchConfig:
    """``plain`` | ``[<draft>:]chain<S>[c<threshold>]`` | ``[<draft>:]tree<K>x<n>[s<S>]`` | ``ngram<S>`` |
    ``ngram<K>x<n>[s<S>]`` | ``[<draft>:]chain<S>+ng<G>`` | ``[<draft>:]tree<K>x<n>[s<S>]+ng<G>`` -> BenchConfig
    (validated)."""
    from jaxspec.config import SpecConfig

    name = name.strip()
    if name == "plain":
        return BenchConfig("plain")
    draft_name, _, name_shape = name.rpartition(":")
    base, _, graft = name_shape.partition("+")
    G = 0
    if graft:
        if not (m := re.fullmatch(r"ng(\d+)", graft)) or base.startswith("ngram"):
            raise ValueError(f"unknown bench configuration {name!r}: a hybrid is chain<S>+ng<G> or tree<K>x<n>+ng<G>")
        G = int(m.group(1))
    drafter = "hybrid" if G else "model"
    if m := re.fullmatch(r"chain(\d+)c([0-9.]+)", base):
        s = int(m.group(1))
        if G:
            raise ValueError(f"bench configuration {name!r}: a confidence-scheduled chain grafts nothing")
        cfg = BenchConfig(name, s, 1, s + 1, 0, drafter, draft_name, confidence=float(m.group(2)))
    elif m := re.fullmatch(r"(chain|ngram)(\d+)", base):
        s = int(m.group(2))
        drafter = "ngram" if m.group(1) == "ngram" else drafter
        cfg = BenchConfig(name, s, 1, s + 1 + G, G, drafter, draft_name)
    elif m := re.fullmatch(r"(tree|ngram)(\d+)x(\d+)(?:s(\d+))?", base):
        k, n = int(m.group(2)), int(m.group(3))
        if m.group(1) == "ngram":
            drafter = "ngram"
            s = int(m.group(4)) if m.group(4) else max(tree_steps, -(-(n - 1) // k))  # K paths of <= S tokens
        elif m.group(4):
            s = int(m.group(4))
        else:  # smallest S >= tree_steps (and >= G) with n - 1 - G <= k + (S - 1) k^2
            s = max(tree_steps, G)
            while n - 1 - G > k + (s - 1) * k * k:
                s += 1
        cfg = BenchConfig(name, s, k, n, G, drafter, draft_name)
    else:
        raise ValueError(f"unknown bench configuration {name!r} (plain, chain<S>[c<threshold>], tree<K>x<n>[s<S>], ngram<S>, "
                         f"ngram<K>x<n>[s<S>], chain<S>+ng<G>, tree<K>x<n>[s<S>]+ng<G>)")
    if drafter == "ngram" and draft_name:
        raise ValueError(f"bench configuration {name!r}: n-gram configurations take no named draft")
    spec = cfg.spec()  # validates
    if drafter == "ngram":
        from jaxspec.model.drafts.ngram import NgramConfig, NgramLookup

        NgramLookup(NgramConfig()).check_spec(spec)
    return cfg


def load_prompts(args, tokenizer) -> list[list[int]]:
    """Token-id prompts: the first ``--prompt-tokens`` tokens of held-out stdlib files (default)
    or of the given files / directories, spread over packages (``spread_by_package``)."""
    from jaxspec.train.corpus import file_prompts, list_files, spread_by_package, stdlib_files

    need = max(args.batches)
    if args.prompts == "stdlib":
        files = stdlib_files("heldout")
    else:
        files = list_files(args.prompts.split(","), tuple(e for e in args.ext.split(",") if e))
    if tokenizer is None:
        raise ValueError("the target has no tokenizer.json; bench prompts are text files")
    prompts = file_prompts(tokenizer, spread_by_package(files), max(need, args.num_prompts), args.prompt_tokens)
    if not prompts:
        raise ValueError(f"no prompt file has more than {args.prompt_tokens + 16} tokens")
    return prompts


def run_sweep(target, draft, prompts, configs, batches, *, max_new_tokens, repeats, temperature=0.0,
              page_size=16, ngram=None) -> list[dict]:
    """Measures every (batch, configuration); returns one row per measurement. ``draft``: the
    model draft of chain / tree / hybrid configurations, or a dict of them by name
    (``BenchConfig.draft_name``; "" is the default); ``ngram``: the ``NgramDraft`` of n-gram and
    hybrid configurations (default ``NgramDraft()``).

    Per batch size: every configuration is warmed up (compiled) first, then the timed runs go
    round-robin over the configurations ``repeats`` times, so a change in machine load hits
    all of them alike; tokens/s is the median of a configuration's runs.
    """
    import jaxspec as js
    from tqdm.auto import tqdm

    drafts = draft if isinstance(draft, dict) else {"": draft}
    rows = []
    ngram = js.NgramDraft() if ngram is None else ngram
    longest = max(len(p) for p in prompts)
    sampling = js.SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=())
    bar = tqdm(total=len(batches) * len(configs) * (repeats + 1), desc="bench", unit="run", dynamic_ncols=True)
    for batch in batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        engine = js.EngineConfig(page_size=page_size, max_batch=batch, max_seq_len=longest + max_new_tokens + 64)
        runnable, results = [], {}
        for cfg in configs:
            bar.set_postfix(batch=batch, config=cfg.name, phase="warm-up")
            kw = dict(draft=cfg.draft(drafts, ngram), spec=cfg.spec(), sampling=sampling, engine=engine,
                      progress=False)
            try:
                js.generate(target, batch_prompts, **kw)  # warm-up: compiles
                runnable.append((cfg, kw))
                results[cfg.name] = []
            except NotImplementedError as e:
                results[cfg.name] = e
                bar.update(repeats)
            bar.update(1)
        for _ in range(repeats):
            for cfg, kw in runnable:
                bar.set_postfix(batch=batch, config=cfg.name, phase="timed")
                results[cfg.name].append(js.generate(target, batch_prompts, **kw))
                bar.update(1)
        plain_tps = None
        for cfg in configs:
            row = dict(config=cfg.name, batch=batch, num_steps=cfg.num_steps, topk=cfg.topk,
                       num_draft_tokens=cfg.num_draft_tokens, ngram_tokens=cfg.ngram_tokens, drafter=cfg.drafter,
                       temperature=temperature,
                       draft=None if cfg.is_plain or cfg.drafter == "ngram" else (cfg.draft_name or "default"))
            res = results[cfg.name]
            if isinstance(res, Exception):
                rows.append(dict(row, error=str(res)))
                continue
            tps = [sum(s.num_tokens for s in o.stats) / o.wall_seconds for o in res]
            med = statistics.median(tps)
            if cfg.is_plain:
                plain_tps = med
            steps = max(len(s.accept_lens) for s in res[-1].stats) or 1  # the batch runs its steps together
            verified = [v for s in res[-1].stats for v in s.verify_lens]
            row.update(tokens_per_s=med, tokens_per_s_runs=tps, wall_s_runs=[o.wall_seconds for o in res],
                       tokens=sum(s.num_tokens for s in res[-1].stats), confidence=cfg.confidence,
                       mean_verified=sum(verified) / len(verified) if verified else 1.0,
                       ms_per_step=1e3 * statistics.median(o.wall_seconds for o in res) / steps,
                       mean_accept_len=1.0 if cfg.is_plain else res[-1].mean_accept_len,
                       accept_rate_per_position=accept_rate_per_position(res[-1].stats),
                       speedup=(med / plain_tps) if plain_tps else None)
            rows.append(row)
    bar.close()
    return rows


def accept_rate_per_position(stats) -> list[float]:
    """Over every request's verify steps: the share in which the i-th draft token was accepted
    (``RequestStats.accepted_per_position`` summed, over the number of steps); [] for plain."""
    steps = sum(len(s.accept_lens) for s in stats)
    depth = max((len(s.accepted_per_position) for s in stats), default=0)
    if not steps or not depth:
        return []
    return [sum(s.accepted_per_position[i] for s in stats if i < len(s.accepted_per_position)) / steps
            for i in range(depth)]


def format_table(rows: list[dict]) -> str:
    w = max([12] + [len(r["config"]) + 2 for r in rows])
    head = (f"{'config':<{w}}{'S':>3}{'topk':>5}{'n':>4}{'batch':>6}{'tokens/s':>11}{'speedup':>9}{'accept':>8}"
            f"{'verified':>9}{'ms/step':>9}  accepted at draft position 1, 2, ...")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<{w}}{r['num_steps']:>3}{r['topk']:>5}{r['num_draft_tokens']:>4}"
                         f"{r['batch']:>6}  unsupported: {r['error']}")
            continue
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        per_position = " ".join(f"{x:.2f}" for x in r.get("accept_rate_per_position", []))
        lines.append(f"{r['config']:<{w}}{r['num_steps']:>3}{r['topk']:>5}{r['num_draft_tokens']:>4}{r['batch']:>6}"
                     f"{r['tokens_per_s']:>11.1f}{sp:>9}{r['mean_accept_len']:>8.2f}{r.get('mean_verified', 1.0):>9.2f}"
                     f"{r.get('ms_per_step', 0.0):>9.1f}  {per_position}".rstrip())
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Three panels: speedup vs plain and mean accept length per configuration (a line per batch), and
    the acceptance rate at each draft position (a line per configuration, smallest batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = list(dict.fromkeys(r["config"] for r in ok))
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 0.7 * len(names) + 8), 4.5))
    for batch in sorted({r["batch"] for r in ok}):
        by = {r["config"]: r for r in ok if r["batch"] == batch}
        xs = [i for i, n in enumerate(names) if n in by]
        axes[0].plot(xs, [by[names[i]]["speedup"] or 0 for i in xs], "o-", label=f"batch {batch}")
        axes[1].plot(xs, [by[names[i]]["mean_accept_len"] for i in xs], "o-", label=f"batch {batch}")
    axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
    axes[0].set_ylabel("speedup vs plain (tokens/s)")
    axes[1].set_ylabel("mean accept length")
    for ax in axes[:2]:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right")
        ax.grid(alpha=0.3)
        ax.legend()
    smallest = min((r["batch"] for r in ok), default=0)
    for r in ok:
        rates = r.get("accept_rate_per_position") or []
        if r["batch"] == smallest and rates:
            axes[2].plot(range(1, len(rates) + 1), rates, "o-", label=r["config"])
    axes[2].set_xlabel("draft position")
    axes[2].set_ylabel(f"acceptance rate (batch {smallest})")
    axes[2].set_ylim(0, 1)
    axes[2].grid(alpha=0.3)
    if axes[2].lines:
        axes[2].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_name() -> str:
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return f"{d.platform.upper()} {d.device_kind}"


def cmd_bench(args) -> int:
    import jaxspec as js
    from jaxspec.demo import DEMO_DFLASH, DEMO_DRAFT, DEMO_DSPARK, DEMO_PEAGLE, DEMO_TARGET

    target_path = args.target or DEMO_TARGET
    draft_path = args.draft or (DEMO_DRAFT if args.target is None else None)
    named = {"eagle3": DEMO_DRAFT, "dflash": DEMO_DFLASH, "dspark": DEMO_DSPARK,
             "peagle": DEMO_PEAGLE} if args.target is None else {}
    for item in filter(None, (x.strip() for x in (args.drafts or "").split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--drafts takes name=DIR entries, got {item!r}")
        named[name] = path
    if not args.batches or any(b < 1 for b in args.batches):
        raise ValueError(f"--batches must be positive ints, got {args.batches}")
    configs = [parse_config(c, args.tree_steps) for c in args.configs.split(",") if c.strip()]
    if not configs:
        raise ValueError("--configs is empty")
    if not configs[0].is_plain:
        configs.insert(0, parse_config("plain"))  # speedups need the baseline first
    target = js.load_model(target_path, dtype=args.dtype, progress=False)
    if any(c.drafter != "ngram" and not c.is_plain and not c.draft_name for c in configs) and not draft_path:
        raise ValueError("chain, tree and hybrid configurations need --draft (or a named draft, '<name>:chain5')")
    unknown = sorted({c.draft_name for c in configs if c.draft_name and c.draft_name not in named})
    if unknown:
        raise ValueError(f"configurations name unknown drafts {unknown}; known: {sorted(named)} (--drafts name=DIR)")
    drafts = {"": js.load_draft(draft_path, target) if draft_path else None}
    for name in sorted({c.draft_name for c in configs if c.draft_name}):
        drafts[name] = js.load_draft(named[name], target)
    ngram = js.NgramDraft(max_ngram=args.ngram_max, min_ngram=args.ngram_min)
    for c in configs:  # a shape a draft cannot run (e.g. a chain longer than a DFlash block) fails here
        if not c.is_plain:
            c.draft(drafts, ngram).config.check_spec(c.spec())
    prompts = load_prompts(args, target.tokenizer)
    print(f"target {target_path}\ndraft  {draft_path} {', '.join(f'{k}={named[k]}' for k in drafts if k)}\n"
          f"device {device_name()}\n"
          f"{len(prompts)} prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}, batches {args.batches}, {args.repeats} repeats", file=sys.stderr)
    t = time.perf_counter()
    rows = run_sweep(target, drafts, prompts, configs, args.batches, max_new_tokens=args.max_new_tokens,
                     repeats=args.repeats, temperature=args.temperature, page_size=args.page_size, ngram=ngram)
    table = format_table(rows)
    print(table)
    result = dict(
        device=device_name(), target=_shown(target_path), draft=draft_path and _shown(draft_path),
        drafts={k: _shown(named[k]) for k in drafts if k}, dtype=args.dtype, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens, num_prompts=len(prompts),
        repeats=args.repeats, seconds=time.perf_counter() - t, command=" ".join(["jaxspec"] + sys.argv[1:]),
        rows=rows,
    )
    out_json = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    png = args.png or os.path.splitext(out_json)[0] + ".png"
    plot(rows, png, f"jaxspec bench: {device_name()}, T={args.temperature}")
    print(f"wrote {out_json} and {png}", file=sys.stderr)
    return 0


def _shown(path: str) -> str:
    """A path as recorded in the JSON: relative to the working directory when under it, so
    results committed from a checkout name no machine-specific directory."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="sweep plain vs speculative decoding (table, JSON, PNG)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF checkpoint directory (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft checkpoint (default: the demo EAGLE-3 head)")
    p.add_argument("--drafts", default=None,
                   help="named drafts for '<name>:' configurations, name=DIR,... (demo: eagle3, dflash, dspark, peagle)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated (default: the full sweep)")
    p.add_argument("--batches", type=_ints, default=[1, 4, 16], help="comma-separated batch sizes (default 1,4,16)")
    p.add_argument("--tree-steps", type=int, default=5, help="default draft depth S of tree configurations")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix n-gram drafts look up (default 4)")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix n-gram drafts look up (default 1)")
    p.add_argument("--prompts", default="stdlib", help="'stdlib' (held-out files) or files/directories, comma-separated")
    p.add_argument("--ext", default=".py", help="suffixes taken from prompt directories")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", default="runs/bench/bench.json", help="JSON output (the PNG goes next to it)")
    p.add_argument("--png", default=None, help="PNG output (default: --out with .png)")
    p.set_defaults(func=cmd_bench)
    return p
