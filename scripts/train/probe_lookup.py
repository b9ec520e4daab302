"""Small CPU probe: how fast does single-hop lookup (or two-hop) emerge in a shrunken model of the bundled layout?

    python3 scripts/train/probe_lookup.py --layers LLLF --hidden 64 --minutes 4
    python3 scripts/train/probe_lookup.py --value-weight 0.0 --lr 1e-3 --minutes 4   # variants
    python3 scripts/train/probe_lookup.py --kind two_hop --evidence --minutes 20      # two-hop questions only

Trains a fresh Qwen3.5-layout model (L = Gated DeltaNet layer, F = full attention) on prompts of one
question kind (scripts/train/train_data.py encoding and collation, the trainer's loss) and prints first-turn
teacher-forced exact match per relation (lives / job / code, or two_hop) on validation prompts as it
goes, so training-setup hypotheses can be compared in minutes instead of GPU runs.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import Batch, class_token_ids, collate, encode  # noqa: E402
from train_model import DEFAULT_MODEL  # noqa: E402
from train_net import Qwen35ForTraining, collapse_rows, deviation_norm, respread_rows  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from hypic.data.notes import RELATIONS as FACT_RELATIONS  # noqa: E402
from hypic.data.notes import lookup_relation  # noqa: E402
from hypic.data.tasks import KINDS, QA, Prompt, TaskSpec, make_prompt  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("lookup", "two_hop"), default="lookup", help="the question kind trained on")
    p.add_argument("--layers", default="LLLF", help="one letter per layer: L linear attention, F full attention")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--notes", type=int, nargs=2, default=(2, 4), help="fewest and most notes")
    p.add_argument("--note-tokens", type=int, nargs=2, default=(32, 96))
    p.add_argument("--facts", type=int, nargs=2, default=(1, 2), help="facts per note")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--relations", nargs="+", default=list(FACT_RELATIONS), help="relations of the random facts")
    p.add_argument("--restate", action="store_true", help="replies restate the fact (see restated())")
    p.add_argument("--evidence", action="store_true",
                   help="replies restate their evidence as the trainer's do (TaskSpec.restate: 'Note: Mark lives in "
                        "Oslo. Answer: Oslo')")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as the trainer on a GPU")
    p.add_argument("--save", default="",
                   help="at the end, write a train_model.py checkpoint here (stage 0, fresh schedule), so a probe "
                        "of the bundled layout (--layers LLLFLLLF --hidden 256) that bound can be trained on")
    p.add_argument("--value-weight", type=float, default=1.0,
                   help="loss weight of answer-value tokens relative to the reply's other tokens (1: as trained)")
    p.add_argument("--collapse", type=float, default=0.0,
                   help="start with the city and job embeddings collapsed: add one shared direction per class of "
                        "this many times their norm (3: pairwise cosine ~0.9, as in the GPU checkpoint)")
    p.add_argument("--respread-at", type=int, default=0,
                   help="at this step give the city and job rows fresh deviations of 1.55 times their class "
                        "mean's norm (train_model.py --respread on the GPU checkpoint: companies' 1.95 vs 1.26)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def build(args: argparse.Namespace) -> Qwen35ForTraining:
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    head = max(16, args.hidden // 4)
    cfg.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden, head_dim=head, linear_key_head_dim=head,
               linear_value_head_dim=head, num_hidden_layers=len(args.layers),
               layer_types=["full_attention" if c == "F" else "linear_attention" for c in args.layers])
    torch.manual_seed(args.seed)
    return Qwen35ForTraining(cfg)


RELATIONS = ("lives", "job", "code", "two_hop")
"""What the probe tallies a question by: a lookup's relation, or two_hop."""


def relation(question: str) -> int:
    found = lookup_relation(question)  # the probe asks companies only in two-hop questions
    return RELATIONS.index("two_hop" if found == "hosts" else found)


def restated(prompt: Prompt) -> Prompt:
    """The prompt with each reply restating its fact as the answer itself ("Answer: Mark lives in Oslo"): the
    value then follows the same tokens as in the note (a reply-format experiment; `prompt` made with restate)."""
    return replace(prompt, qas=tuple(QA(qa.question, qa.evidence.removesuffix("."), qa.kind) for qa in prompt.qas))


def rows_of(tokenizer: Tokenizer, prompts: list[Prompt], all_questions: bool) -> list[tuple]:
    """collate() rows whose "kinds" are RELATIONS indices (only the probe's own tally reads them)."""
    return [encode(tokenizer, p, all_questions) + ([relation(qa.question) for qa in p.qas], True) for p in prompts]


def batches(rows: list[tuple], token_budget: int) -> list[Batch]:
    """Length-sorted rows cut into padded batches of about `token_budget` tokens."""
    rows, out, start = sorted(rows, key=lambda r: len(r[0])), [], 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and (end + 1 - start) * len(rows[end][0]) <= token_budget:
            end += 1
        out.append(collate(rows[start:end], 64))
        start = end
    return out


def token_weights(batch: Batch, value_weight: float) -> torch.Tensor:
    """Loss weight per supervised token, summing to one: `value_weight` on the answer's value tokens,
    1 on "Answer", ":" and <|im_end|> (value_weight 1 is the trainer's plain mean)."""
    w = torch.ones(len(batch.targets))
    first = {a: i for i, a in reversed(list(enumerate(batch.answer.tolist())))}
    length = collections.Counter(batch.answer.tolist())
    for a, i in first.items():
        w[i + 2: i + length[a] - 1] = value_weight
    return w / w.sum()


PHRASES = (" lives in ", " works as ", "'s locker code is ", " hosts ")
"""The fact sentence's phrase of each of RELATIONS (hypic/data/notes.py _fact; two_hop: the companies)."""


def same_relation_facts(prompt: Prompt) -> int:
    """k: facts in the notes with the relation of the first question (the asked fact included)."""
    phrase = PHRASES[relation(prompt.qas[0].question)]
    return sum(note.count(phrase) for note in prompt.notes)


@torch.no_grad()
def first_turn_hits(net: Qwen35ForTraining, tokenizer: Tokenizer, prompts: list[Prompt], bf16: bool) -> list[bool]:
    """Teacher-forced exact match of each prompt's first answer, in prompt order."""
    net.eval()
    rows = [encode(tokenizer, p, False) + ([i], True) for i, p in enumerate(prompts)]  # kinds: prompt index
    hits = [False] * len(prompts)
    for batch in batches(rows, 8192):
        logits = forward(net, batch, bf16)
        wrong = torch.zeros(len(batch.kinds)).index_add_(
            0, torch.from_numpy(batch.answer), (logits.argmax(-1).cpu() != torch.from_numpy(batch.targets)).float())
        for i, ok in zip(batch.kinds.tolist(), (wrong == 0).tolist()):
            hits[i] = ok
    net.train()
    return hits


def forward(net: Qwen35ForTraining, batch: Batch, bf16: bool) -> torch.Tensor:
    """Logits at the batch's supervised positions, on the model's device."""
    device = net.model.embed_tokens.weight.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        return net(torch.from_numpy(batch.ids).long().to(device), torch.from_numpy(batch.positions).to(device)).float()


def rates(groups: list[str], hits: list[bool]) -> dict[str, float]:
    """Exact match per group label, in sorted label order."""
    count, ok = collections.Counter(groups), collections.Counter(g for g, h in zip(groups, hits) if h)
    return {g: round(ok[g] / count[g], 3) for g in sorted(count)}


def evaluate(net: Qwen35ForTraining, tokenizer: Tokenizer, prompts: list[Prompt], bf16: bool) -> dict[str, dict]:
    """First-turn teacher-forced exact match per relation and overall ("em"), and per k = same-relation
    facts in the context, capped at 4 ("em_k"), with the number of prompts per k ("n_k") and the EM of
    copying a random same-relation value, the mean of 1/k ("chance": EM well above it needs binding)."""
    hits, ks = first_turn_hits(net, tokenizer, prompts, bf16), [same_relation_facts(p) for p in prompts]
    by_rel = rates([RELATIONS[relation(p.qas[0].question)] for p in prompts], hits)
    labels = ["4+" if k >= 4 else str(k) for k in ks]
    return {"em": {**{r: by_rel[r] for r in RELATIONS if r in by_rel}, "all": round(sum(hits) / len(hits), 3)},
            "em_k": rates(labels, hits), "n_k": dict(sorted(collections.Counter(labels).items())),
            "chance": round(sum(1 / k for k in ks) / len(ks), 3)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    weights = tuple(float(kind == args.kind) for kind in KINDS)
    spec = TaskSpec(args.notes[0], args.notes[1], args.note_tokens[0], args.note_tokens[1], weights,
                    rich_names=False, questions=args.questions, facts_per_note=tuple(args.facts),
                    relations=tuple(args.relations), restate=args.evidence or args.restate)
    shape = restated if args.restate else (lambda prompt: prompt)
    val = [shape(make_prompt(spec, "validation", i)) for i in range(args.eval_prompts)]
    net = build(args).to(args.device)
    if args.collapse:
        weight, g = net.model.embed_tokens.weight, torch.Generator().manual_seed(args.seed)
        for name in ("cities", "jobs"):
            collapse_rows(weight, class_token_ids(tokenizer, name), args.collapse, g)
    classes = {n: class_token_ids(tokenizer, n) for n in ("cities", "jobs", "companies")}
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    rng, started, step, seen, answers = random.Random(args.seed), time.monotonic(), 0, 0, 0
    print(json.dumps({"args": vars(args), "params": sum(p.numel() for p in net.parameters())}), flush=True)
    while time.monotonic() - started < 60 * args.minutes:
        prompts, tokens = [], 0
        while tokens < args.tokens_per_step:
            prompts.append(shape(make_prompt(spec, "train", rng.getrandbits(40))))
            tokens += len(prompts[-1].text()) // 4
        for batch in batches(rows_of(tokenizer, prompts, True), args.tokens_per_step):
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
            logits = forward(net, batch, args.bf16)
            ce = F.cross_entropy(logits, torch.from_numpy(batch.targets).to(logits.device), reduction="none")
            loss = (ce * token_weights(batch, args.value_weight).to(logits.device)).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step, seen, answers = step + 1, seen + batch.tokens, answers + len(batch.kinds)
            if step == args.respread_at:
                weight, g = net.model.embed_tokens.weight, torch.Generator().manual_seed(args.seed + 1)
                for name in ("cities", "jobs"):
                    rows = classes[name]
                    respread_rows(weight, rows, 1.55 * weight[rows].mean(0).norm().item(), g)
                print(json.dumps({"step": step, "respread": ["cities", "jobs"],
                                  **evaluate(net, tokenizer, val, args.bf16)}), flush=True)
            if step % args.eval_every == 0:
                spread = {n: round(deviation_norm(net.model.embed_tokens.weight, r) /
                                   net.model.embed_tokens.weight[r].norm(dim=-1).mean().item(), 3)
                          for n, r in classes.items()}
                print(json.dumps({"step": step, "s": round(time.monotonic() - started), "tokens": seen,
                                  "answers": answers, "loss": round(loss.item(), 3),
                                  **evaluate(net, tokenizer, val, args.bf16), "spread": spread}), flush=True)
    print(json.dumps({"final": True, "step": step, "tokens": seen, "answers": answers,
                      **evaluate(net, tokenizer, val, args.bf16)}), flush=True)
    if args.save:
        from train_model import Checkpoint, fresh_curve, fresh_state

        Checkpoint(Path(args.save)).save(net, opt, fresh_state(step), fresh_curve())


if __name__ == "__main__":
    main()
