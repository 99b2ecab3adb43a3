"""Build the pretraining corpus and train its BPE tokenizer, once, into a cache.

    python -m experiments.prepare_corpus                      # .cache/corpus
    python -m experiments.prepare_corpus --vocab_size 4096 --out /tmp/corpus

The corpus (`rlcode.data.corpus`) is the running interpreter's standard library without its tests,
plus the non-test, non-evaluation files of the mined projects when ``--mined_dir`` holds a cache
prepared by ``experiments.prepare_mined`` (left out with a message otherwise), deduplicated and
split by file hash. The tokenizer (`rlcode.data.bpe`) is trained on the train split only and
saved in ``<out>/tokenizer`` (``tokenizer.json`` + ``tokenizer_config.json``, loadable with
``--config.tokenizer=<out>/tokenizer``). Writes ``manifest.json`` (every file, with licence) and
``report.json`` (totals, what was left out, bytes per token on the held-out split for the BPE and
for bytes) and prints the same as a table. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from experiments.cli import summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.prepare_corpus", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(".cache", "corpus"), help="output directory")
    p.add_argument("--mined_dir", default=os.path.join(".cache", "mined"),
                   help="a cache of experiments.prepare_mined (its train projects' code joins the corpus)")
    p.add_argument("--stdlib", default=None, help="the standard library to read (default: the running interpreter's)")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of files held out, by hash")
    p.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary, special tokens and bytes included")
    p.add_argument("--max_bytes", type=int, default=1 << 20, help="leave out files larger than this")
    args = p.parse_args(argv)
    if not 0 <= args.heldout < 1:
        p.error(f"--heldout must be in [0, 1), got {args.heldout}")
    if args.vocab_size <= 263:
        p.error(f"--vocab_size must exceed 263 (7 special tokens + 256 bytes), got {args.vocab_size}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from experiments.prepare_mined import PROJECTS
    from rlcode.data import bpe, corpus
    from rlcode.tokenizer import ByteTokenizer

    t0 = time.perf_counter()
    skipped = corpus.Skipped()
    docs = list(corpus.stdlib_documents(args.stdlib, max_bytes=args.max_bytes, skipped=skipped))
    mined_used = os.path.exists(os.path.join(args.mined_dir, "tasks.jsonl"))
    if mined_used:
        docs += corpus.mined_documents(args.mined_dir, {n: p.licence for n, p in PROJECTS.items()},
                                       max_bytes=args.max_bytes, skipped=skipped)
    else:
        print(f"{args.mined_dir}: no mined-task cache (python -m experiments.prepare_mined); the corpus is the "
              "standard library alone")
    built = corpus.build(docs, args.heldout, skipped)
    manifest = corpus.write(built, args.out)
    t1 = time.perf_counter()
    tok = bpe.train(built.texts("train"), args.vocab_size)
    tokenizer = bpe.save(tok, os.path.join(args.out, "tokenizer"))
    t2 = time.perf_counter()
    heldout = built.texts("heldout")  # compression is measured on files the tokenizer never saw
    report = {
        "command": "python -m experiments.prepare_corpus " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": manifest["python"], "splits": manifest["splits"], "sources": manifest["sources"],
        "left_out": manifest["left_out"], "mined_dir": args.mined_dir if mined_used else None,
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "path": os.path.join(args.out, "tokenizer"),
                      "heldout_bytes_per_token": round(bpe.bytes_per_token(tokenizer, heldout), 3) if heldout else None,
                      "heldout_bytes_per_token_byte_level":
                          round(bpe.bytes_per_token(ByteTokenizer(), heldout), 3) if heldout else None},
        "seconds": {"corpus": round(t1 - t0, 1), "tokenizer": round(t2 - t1, 1)},
    }
    with open(os.path.join(args.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print("| source | licence | train files | train MB | held-out files | held-out MB |")
    print("|---|---|---|---|---|---|")
    for name, t in report["sources"].items():
        print(f"| {name} | {t['licence']} | {t['train']['files']} | {t['train']['bytes'] / 1e6:.2f} | "
              f"{t['heldout']['files']} | {t['heldout']['bytes'] / 1e6:.2f} |")
    print(f"left out: {report['left_out']}")
    ratio = report["tokenizer"]["heldout_bytes_per_token"]
    measured = f"{ratio:.2f} bytes per token on the held-out split (bytes: 1.00)" if heldout else "no held-out file"
    print(f"tokenizer: {tokenizer.vocab_size} tokens, {measured}; wrote {args.out}/ in {t2 - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
