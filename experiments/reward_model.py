"""Train a Bradley-Terry reward model on pairwise choices and measure its gap to the true objective.

    python -m experiments.reward_model                       # simulated users on synthesis tasks (~20 min on 2 cores)
    python -m experiments.reward_model --quick               # a smoke run
    python -m experiments.reward_model --prefs=train.jsonl --heldout_prefs=heldout.jsonl   # your own choices

Simulated (the default): for `--tasks` synthesis tasks, candidate completions are the reference
body, mutants of it and verbose copies with comment lines (`rlcode.feedback.simulated_users`).
Each is graded in the sandbox: its gold score is the fraction of the task's held-out tests it
passes, which no user and no reward model sees. A `SimulatedUser` with rationality `--beta`, label
noise `--flip` and, for each value in `--biases`, a preference of that many logits per comment
line, labels pairs of candidates of the same prompt. The pairs are written as preference files
(`rlcode.feedback.preferences`), split by prompt into train and held-out, and one reward model per
bias is trained on them: the policy architecture with its value head, from the committed pretrained
base `checkpoints/code_base` (its BPE tokenizer) by default, or any checkpoint `--init_from`, or a
byte-level model from scratch (`--init_from=`).

Reported per bias, on held-out prompts: pairwise accuracy against the users' labels and against
gold (pairs whose gold scores differ, the better one as the winner), the calibration error (ECE)
of sigmoid(delta) against the labels, the rank correlation (Spearman) of the reward with gold over
the held-out candidates, and the verbosity probe: among held-out pairs of a candidate and its
verbose copy (equal gold), the fraction in which the reward model prefers the verbose one (0.5 is
indifference; a biased user's model should drift above it, which is the gap to gold). A table,
JSON (`runs/reward_model/`, or `--publish`) and a figure of held-out accuracy over training.
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
from absl import app, flags, logging

from experiments.cli import PUBLISH_HELP, fail, output_paths

_TASKS = flags.DEFINE_integer("tasks", 400, "Synthesis tasks whose candidates are compared (simulated mode).")
_BIASES = flags.DEFINE_list("biases", ["0", "1.5"], "Users' preference per comment line, in logits; one model each.")
_BETA = flags.DEFINE_float("beta", 20.0, "Users' rationality: logits per unit of gold difference.")
_FLIP = flags.DEFINE_float("flip", 0.1, "Probability that a user's label is reversed.")
_HELDOUT = flags.DEFINE_float("heldout", 0.2, "Fraction of prompts held out (simulated mode).")
_STEPS = flags.DEFINE_integer("steps", 300, "Reward-model training steps.")
_BATCH = flags.DEFINE_integer("batch_pairs", 8, "Pairs per training step.")
_LR = flags.DEFINE_float("lr", 2e-4, "Peak learning rate (AdamW, warmup then cosine).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 50, "Held-out evaluation every this many steps.")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Width of the reward model (from scratch).")
_LAYERS = flags.DEFINE_integer("layers", 2, "Layers of the reward model (from scratch).")
_MAX_LEN = flags.DEFINE_integer("max_len", 384, "Tokens of prompt + completion kept (the prompt's start is cut).")
_INIT_FROM = flags.DEFINE_string("init_from", "checkpoints/code_base", "A Hugging Face checkpoint directory to start "
                                  "from, with its tokenizer (empty: a byte-level model from scratch, --d_model, --layers).")
_PREFS = flags.DEFINE_string("prefs", "", "A preference file to train on instead of simulated users.")
_HELDOUT_PREFS = flags.DEFINE_string("heldout_prefs", "", "Held-out preference file (default: split --prefs by prompt).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the tasks, candidates, labels and training.")
_QUICK = flags.DEFINE_bool("quick", False, "20 tasks, 10 steps: a smoke run.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/reward_model", "Preference files and models, one subdirectory per bias.")
_OUT = flags.DEFINE_string("out", None, "JSON summary (default runs/reward_model/reward_model[_quick].json).")
_PNG = flags.DEFINE_string("png", None, "PNG (default: next to the JSON).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)


def simulated_candidates(num_tasks: int, seed: int, log=print) -> list[dict]:
    """Per task: its prompt, candidate completions, their gold scores and which are verbose copies of which."""
    from rlcode.envs.tasks import synth
    from rlcode.feedback import simulated_users as su
    from rlcode.train.engine import default_pool
    from rlcode.train.rollout import Grader

    rng = random.Random(seed)
    tasks = synth.make_split("train", num_tasks, seed=seed, levels=(1, 2, 3))
    items = []
    for task in tasks:
        texts = su.candidates(task, rng, mutants=3, verbose=2)
        items.append({"task": task, "prompt": synth.completion_prompt(task), "texts": texts})
    flat = [(item["task"], text) for item in items for text in item["texts"]]
    t0 = time.perf_counter()
    pool = default_pool(2, 10.0)
    try:
        gold, valid, _, _ = Grader(pool, timeout=5.0).grade([t for t, _ in flat], [c for _, c in flat])
    finally:
        pool.close()
    if not valid.all():
        raise RuntimeError(f"{int((~valid).sum())} of {len(flat)} gradings did not complete (sandbox failures)")
    log(f"graded {len(flat)} candidates of {len(items)} tasks in {time.perf_counter() - t0:.1f} s "
        f"(mean gold {gold.mean():.3f}, solved {np.mean(gold == 1.0):.1%})")
    k = 0
    for item in items:
        n = len(item["texts"])
        item["gold"] = [float(g) for g in gold[k:k + n]]
        k += n
        # A verbose copy is the base with comment lines added: same code lines.
        strip = lambda t: [line for line in t.splitlines() if not line.strip().startswith("#")]
        item["verbose_of"] = {j: i for j, tj in enumerate(item["texts"]) for i, ti in enumerate(item["texts"])
                              if i != j and strip(ti) == strip(tj) and len(tj) > len(ti)}
        del item["task"]
    return items


def spearman(a, b) -> float:
    ra, rb = (np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(float) for x in (a, b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def gold_report(scorer, items: list[dict]) -> dict[str, float]:
    """Accuracy against gold, Spearman with gold, and the verbosity probe on held-out items."""
    prompts = [it["prompt"] for it in items for _ in it["texts"]]
    texts = [t for it in items for t in it["texts"]]
    rewards = scorer.score(prompts, texts)
    correct, probe, corr, k = [], [], [], 0
    for it in items:
        n = len(it["texts"])
        r, g = rewards[k:k + n], np.asarray(it["gold"])
        k += n
        for i in range(n):
            for j in range(i + 1, n):
                if g[i] != g[j]:
                    d = (r[i] - r[j]) * np.sign(g[i] - g[j])
                    correct.append(1.0 if d > 0 else 0.5 if d == 0 else 0.0)
        for j, i in it["verbose_of"].items():
            probe.append(1.0 if r[j] > r[i] else 0.5 if r[j] == r[i] else 0.0)
        corr.append(spearman(r, g))
    return {"gold_accuracy": float(np.mean(correct)) if correct else float("nan"),
            "gold_pairs": float(len(correct)),
            "spearman_gold": float(np.nanmean(corr)) if corr else float("nan"),
            "prefers_verbose": float(np.mean(probe)) if probe else float("nan"), "verbose_pairs": float(len(probe))}


def build_model(tokenizer_vocab: int, seed: int):
    from rlcode.models import hf
    from rlcode.models.transformer import model_config

    if _INIT_FROM.value:
        section = model_config(init_from=_INIT_FROM.value, value_head=True)
        return hf.initial_model(section, seed)
    section = model_config(vocab_size=tokenizer_vocab, d_model=_D_MODEL.value, num_layers=_LAYERS.value,
                           num_heads=4, num_kv_heads=2, head_dim=_D_MODEL.value // 4, ffw_dim=3 * _D_MODEL.value,
                           value_head=True)
    return hf.initial_model(section, seed)


def plot(runs: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, run in runs.items():
        steps = [h["step"] for h in run["history"]]
        line, = ax.plot(steps, [h["heldout/accuracy"] for h in run["history"]], marker="o", ms=3,
                        label=f"{name}: vs users' labels")
        if "gold_history" in run:
            ax.plot(steps, run["gold_history"], ls="--", color=line.get_color(), marker="s", ms=3,
                    label=f"{name}: vs gold (tests passed)")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set_xlabel("reward-model training step")
    ax.set_ylabel("held-out pairwise accuracy")
    ax.set_ylim(0.4, 1.0)
    ax.set_title("Bradley-Terry reward model on held-out prompts (one seed)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax reports every save at INFO
    quick = _QUICK.value
    out, png = output_paths("reward_model", quick, _OUT.value, _PNG.value, _PUBLISH.value)
    try:
        biases = [float(b) for b in _BIASES.value]
    except ValueError:
        fail(f"--biases must be numbers, got {_BIASES.value}")
    if _HELDOUT_PREFS.value and not _PREFS.value:
        fail("--heldout_prefs needs --prefs")
    for path in (_PREFS.value, _HELDOUT_PREFS.value):
        if path and not os.path.isfile(path):
            fail(f"no preference file {path}")

    from rlcode.feedback import preferences as prefs_lib
    from rlcode.feedback import reward_model as rm
    from rlcode.feedback.simulated_users import SimulatedUser, label_pairs
    from rlcode.tokenizer import ByteTokenizer, load_tokenizer

    tokenizer = load_tokenizer(_INIT_FROM.value) if _INIT_FROM.value else ByteTokenizer()
    steps = 10 if quick else _STEPS.value
    cfg = rm.train_config(steps=steps, batch_pairs=_BATCH.value, eval_every=min(_EVAL_EVERY.value, steps),
                          max_len=_MAX_LEN.value, seed=_SEED.value)
    cfg.optim.update(lr=_LR.value, total_steps=steps, warmup_steps=min(20, steps // 5))
    os.makedirs(_WORKDIR.value, exist_ok=True)
    runs, summary = {}, {"command": "python -m experiments.reward_model " + " ".join(
        f"--{k}={v}" for k, v in (("tasks", _TASKS.value), ("biases", ",".join(_BIASES.value)), ("beta", _BETA.value),
                                  ("flip", _FLIP.value), ("steps", steps), ("seed", _SEED.value))) + (" --quick" if quick else "")}

    if _PREFS.value:  # people's choices
        train = prefs_lib.read_preferences(_PREFS.value)
        held = (prefs_lib.read_preferences(_HELDOUT_PREFS.value) if _HELDOUT_PREFS.value
                else prefs_lib.split_by_prompt(train, _HELDOUT.value)[1])
        if not _HELDOUT_PREFS.value:
            train = prefs_lib.split_by_prompt(train, _HELDOUT.value)[0]
        setups = {"prefs": (train, held, None)}
        summary["command"] = None
    else:
        items = simulated_candidates(min(_TASKS.value, 20) if quick else _TASKS.value, _SEED.value)
        held_prompts = {p.prompt for p in prefs_lib.split_by_prompt(
            [prefs_lib.PreferencePair(it["prompt"], "", "") for it in items], _HELDOUT.value, salt=str(_SEED.value))[1]}
        held_items = [it for it in items if it["prompt"] in held_prompts]
        setups = {}
        for bias in biases:
            user = SimulatedUser(beta=_BETA.value, bias=bias, flip=_FLIP.value, tie_band=0.0)
            rng = random.Random(_SEED.value + 1)
            pairs = [p for n, it in enumerate(items) for p in label_pairs(user, it["prompt"], it["texts"], it["gold"], rng,
                                                                         prefix=f"{n}/")]
            name = f"bias={bias:g}"
            directory = os.path.join(_WORKDIR.value, name)
            os.makedirs(directory, exist_ok=True)
            train = [p for p in pairs if p.prompt not in held_prompts]
            held = [p for p in pairs if p.prompt in held_prompts]
            for split, data in (("train", train), ("heldout", held)):  # the preference files, read back
                prefs_lib.write_preferences(os.path.join(directory, f"{split}.jsonl"), data)
            train = prefs_lib.read_preferences(os.path.join(directory, "train.jsonl"))
            held = prefs_lib.read_preferences(os.path.join(directory, "heldout.jsonl"))
            setups[name] = (train, held, held_items)
        summary.update(tasks=len(items), heldout_tasks=len(held_items),
                       candidates=sum(len(it["texts"]) for it in items),
                       mean_gold=float(np.mean([g for it in items for g in it["gold"]])))

    rows = []
    for name, (train, held, held_items) in setups.items():
        print(f"[{name}] {len(train)} training pairs, {len(held)} held-out pairs")
        model = build_model(tokenizer.vocab_size, _SEED.value)
        gold_history = []

        def on_eval(step, record, scorer, held_items=held_items, gold_history=gold_history):
            if held_items is not None:
                gold_history.append(gold_report(scorer, held_items)["gold_accuracy"])

        scorer, history = rm.train_reward_model(model, tokenizer, train, held, cfg, on_eval=on_eval)
        scorer.save(os.path.join(_WORKDIR.value, name, "model"), extra={"bias": name}, force=True)
        final = history[-1]
        row = {"run": name, "train_pairs": len(train), "heldout_pairs": len(held),
               "accuracy": final["heldout/accuracy"], "ece": final["heldout/ece"], "loss": final["heldout/loss"]}
        if held_items is not None:
            row.update(gold_report(scorer, held_items))
        rows.append(row)
        runs[name] = {"history": history, **({"gold_history": gold_history} if held_items is not None else {})}

    cols = [c for c in ("run", "train_pairs", "heldout_pairs", "accuracy", "gold_accuracy", "ece", "spearman_gold",
                        "prefers_verbose") if c in rows[0]]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    summary.update(rows=rows, runs=runs, beta=_BETA.value, flip=_FLIP.value, steps=steps)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    plot(runs, png)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    app.run(main)
