"""Where does a training checkpoint fail? Teacher-forced exact match on CPU, broken down by answer features.

    python3 scripts/train/diagnose_model.py --ckpt runs/notes --stage 1 --prompts 60
    python3 scripts/train/diagnose_model.py --ckpt runs/notes --stage 1 --extra --first-only --prompts 200
    python3 scripts/train/diagnose_model.py --ckpt runs/notes --eval-spec --prompts 100 --wrong 8

Every answer of every prompt is scored (all chat turns, as in training; `--first-only` keeps the
query segment's answer, as in the final evaluation). Each answer is tagged with: kind, relation
(lookup: lives / job / code), its turn index, answer length in tokens, how many facts of the same
relation the context holds, how often the answer string occurs in the context, and whether the
gold answer's first token was the argmax (errors of the first token are retrieval errors; later
tokens are copying errors). Wrong predictions are decoded from the argmax tokens.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import STAGES, VALUE_CLASSES, class_token_ids, encode  # noqa: E402
from train_net import Qwen35ForTraining, cap_mlp_neurons, deviation_norm, mlp_neuron_peaks, respread_rows  # noqa: E402

from hypic.data.notes import lookup_relation  # noqa: E402
from hypic.data.tasks import EVAL_SPEC, eval_prompts, make_prompts  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[2] / "hypic" / "assets" / "default_model"
RELATION_PATTERNS = {  # regex counting the facts of a relation in the context
    "lives": r" lives in ", "job": r" works as an? ", "code": r"'s locker code is ",
    "linked": r"The person above works at ", "based": r" hosts ",
}


def relation(kind: str, question: str) -> str:
    if kind == "two_hop":
        return "based"
    if kind == "linked":
        return "linked"
    found = lookup_relation(question)  # a long question asks a lookup fact, cut between two segments
    return "based" if found == "hosts" else found  # a hosts lookup counts " hosts " facts, as two-hop does


def score(net, tokenizer, prompts, first_only: bool) -> list[dict]:
    rows, resid = [], []
    hook = net.model.norm.register_forward_hook(lambda m, i, o: resid.append(i[0][0].norm(dim=-1)))
    for p in prompts:
        ids, spans = encode(tokenizer, p, all_questions=not first_only)
        resid.clear()
        with torch.no_grad():
            logits = net(torch.tensor([ids]))[0]
        pred = logits.argmax(-1)
        context = "".join(p.notes)
        for turn, (qa, (start, end)) in enumerate(zip(p.qas, spans)):
            gold = ids[start:end]
            guess = pred[start - 1:end - 1].tolist()
            rel = relation(qa.kind, qa.question)
            rows.append({
                "kind": qa.kind, "rel": rel, "turn": turn, "notes": len(p.notes),
                "ans_tokens": len(tokenizer.encode(" " + qa.answer, add_special_tokens=False).ids),
                "same_rel": len(re.findall(RELATION_PATTERNS[rel], context)),
                "ans_count": context.count(qa.answer),
                "ok": gold == guess,
                "resid": round(resid[0][start + 1].item()),  # final residual norm at ":" of "Answer:" (predicts the value)
                "first_wrong": next((i for i, (g, h) in enumerate(zip(gold, guess)) if g != h), None),
                "gold": tokenizer.decode(gold, skip_special_tokens=False),
                "guess": tokenizer.decode(guess, skip_special_tokens=False),
                "question": qa.question, "context_tokens": len(ids),
                "answer": qa.answer, "context": context,
            })
    hook.remove()
    return rows


def table(rows: list[dict], key) -> None:
    groups = collections.defaultdict(list)
    for r in rows:
        groups[key(r)].append(r["ok"])
    for k in sorted(groups, key=str):
        v = groups[k]
        print(f"    {str(k):<28} n={len(v):4d}  em={sum(v) / len(v):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=Path("runs/notes"))
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--eval-spec", action="store_true", help="EVAL_SPEC pool requests instead of a stage")
    ap.add_argument("--extra", action="store_true", help="the stage's first `extra` spec (lookup practice)")
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--first-only", action="store_true")
    ap.add_argument("--wrong", type=int, default=6, help="wrong predictions to print per kind")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--respread", default="", help="first apply train_model.py --respread (same seed) to these classes")
    ap.add_argument("--json", type=Path, help="write every scored answer here")
    ap.add_argument("--cap-mlp", type=float, default=0.0, help="first apply train_model.py --cap-mlp (layers --cap-layers)")
    ap.add_argument("--cap-layers", default="7")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.loads((args.model_dir / "config.json").read_text())
    net = Qwen35ForTraining(cfg).eval()
    net.load_state_dict({n: t.float() for n, t in load_file(str(args.ckpt / "weights.safetensors")).items()})
    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    if args.eval_spec:
        prompts, name = eval_prompts(-(-args.prompts // 4), "validation", EVAL_SPEC), "EVAL_SPEC"
    elif args.extra:
        spec = STAGES[args.stage].extra[0][0]
        prompts, name = make_prompts(spec, "validation", args.prompts), f"stage {args.stage} extra"
    else:
        prompts, name = make_prompts(STAGES[args.stage].spec, "validation", args.prompts), f"stage {args.stage}"
    weight = net.model.embed_tokens.weight.detach()
    generator = torch.Generator().manual_seed(1)  # as train_model.py --respread with --seed 0
    for cls in filter(None, args.respread.split(",")):
        respread_rows(weight, class_token_ids(tokenizer, cls), deviation_norm(weight, class_token_ids(tokenizer, "companies")),
                      generator)
    if args.cap_mlp:
        sequences = []
        specs = [(s.extra[0][0], 48) for s in STAGES[args.stage: args.stage + 1] if s.extra]
        specs += [(STAGES[args.stage].spec, 48)] + [(STAGES[s].spec, 24) for s in range(args.stage)]
        for spec, n in specs:  # as train_model.MlpCap
            for p in make_prompts(spec, "validation", n):
                ids, spans = encode(tokenizer, p, all_questions=True)
                sequences.append((ids, [i for start, end in spans for i in range(start - 1, end - 1)]))
        layers = {int(x) for x in args.cap_layers.split(",")}
        peaks = [p if i in layers else p * 0 for i, p in enumerate(mlp_neuron_peaks(net, sequences))]
        print(f"cap-mlp {args.cap_mlp:g}: {len(cap_mlp_neurons(net, peaks, args.cap_mlp))} neurons scaled down")
    spread = {}
    for cls in VALUE_CLASSES:  # collapsed classes (~0.2-0.3; ~1 at init) cannot be told apart, so not copied
        ids = class_token_ids(tokenizer, cls)
        spread[cls] = round(deviation_norm(weight, ids) / weight[ids].norm(dim=-1).mean().item(), 3)
    print(f"embedding spread (deviation from the class mean / row norm): {spread}")
    t0 = time.time()
    rows = score(net, tokenizer, prompts, args.first_only or args.eval_spec)
    print(f"{name}: {len(prompts)} prompts, {len(rows)} answers, {time.time() - t0:.0f}s")
    for title, key in [("kind", lambda r: r["kind"]), ("relation", lambda r: r["rel"]),
                       ("kind x turn (0 = query segment)", lambda r: (r["kind"], min(r["turn"], 3))),
                       ("relation x answer tokens", lambda r: (r["rel"], r["ans_tokens"])),
                       ("relation x same-relation facts in context", lambda r: (r["rel"], min(r["same_rel"], 6))),
                       ("relation x answer occurrences in context", lambda r: (r["rel"], min(r["ans_count"], 3))),
                       ("relation x first wrong token (None = right)", lambda r: (r["rel"], r["first_wrong"])),
                       ("kind x notes", lambda r: (r["kind"], r["notes"]))]:
        print(f"  by {title}:")
        table(rows, key)
    by_kind = collections.defaultdict(list)
    for r in rows:
        if not r["ok"]:
            by_kind[r["rel"]].append(r)
    for rel, wrong in sorted(by_kind.items()):
        print(f"  wrong {rel} ({len(wrong)}):")
        for r in wrong[: args.wrong]:
            facts = [s for s in re.split(r"(?<=\.) ", r["context"]) if re.search(RELATION_PATTERNS[r["rel"]], s)]
            print(f"    Q {r['question']!r} gold {r['gold']!r} argmax {r['guess']!r} | same-relation facts {facts[:6]}")
    norms = collections.defaultdict(list)
    for r in rows:
        norms[r["rel"]].append(r["resid"])
    print("  final residual norm (before the last RMSNorm) at the position predicting the value: "
          + str({k: round(sum(v) / len(v)) for k, v in sorted(norms.items())})
          + "  (run 8: lives 57700 vs job ~900; --cap-mlp)")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "context"} for r in rows], indent=0))


if __name__ == "__main__":
    main()
