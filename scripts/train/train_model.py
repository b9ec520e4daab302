"""Trains the bundled Qwen3.5 text model on the notes task, in resumable time-limited runs.

    python scripts/train/probe_lookup.py ... --save runs/notes                    # first: a model that binds (README)
    python scripts/train/train_model.py --ckpt runs/notes --time-limit 540        # one GPU run (resumes)
    python scripts/train/train_model.py --ckpt /tmp/smoke --smoke                 # CPU, under a minute
    torchrun --standalone --nproc_per_node 2 scripts/train/train_model.py --ckpt runs/notes --stage 1  # 2 GPUs
    python scripts/train/make_default_model.py --out hypic/assets/default_model --weights runs/notes/weights.safetensors

Loss is on reply tokens only ("Note: <evidence> Answer: X<|im_end|>", several questions per
context). A curriculum (scripts/train/train_data.py STAGES) opens on short notes of several same-relation
facts (binding names to values), then moves to longer notes, more question kinds and invented
names when the running exact match of a stage passes its gate. From a fresh model, binding may not
appear in this loop's data stream; start from `probe_lookup.py --save` (docs/training.md).
The learning rate follows the cumulative training time: warm-up, constant, then linear decay over
the last `--decay-frac` of `--budget-s`.

The checkpoint directory is compact (each file < 16 MiB): weights.safetensors (bf16, `model.*`
names), optimizer.safetensors (Adam's second moments, bf16; first moments restart at zero and
rebuild in a few steps), state.json (step, stage, time, schedule) and curve.json (loss curve,
throughput and evaluations). Exact match is measured teacher-forced: all answer tokens are the
argmax given the gold prefix, which is exactly when greedy decoding reproduces the answer.

Under torchrun (WORLD_SIZE > 1) the ranks train one model data parallel (DDP; NCCL on CUDA, gloo on
CPU): `--tokens-per-step` is the global batch, each rank builds its share from its own data groups,
and rank 0 alone decides when to stop or save (its clock and training time are broadcast every
step), logs, evaluates and writes the checkpoint.
"""
from __future__ import annotations

import time

STARTED = time.monotonic()  # the run's time limit counts from here, imports included

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import (  # noqa: E402
    RELATIONS,
    STAGES,
    Batch,
    class_token_ids,
    collate,
    encode,
    init_worker,
    make_group,
    relation_index,
    with_mix,
)
from train_net import Qwen35ForTraining, cap_mlp_neurons, deviation_norm, mlp_neuron_peaks, respread_rows  # noqa: E402

from hypic.data.tasks import EVAL_SPEC, KINDS, eval_prompts, make_prompts  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "hypic" / "assets" / "default_model"
SMOKE_DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "head_dim": 16,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory (created or resumed)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL, help="config.json + tokenizer.json")
    p.add_argument("--time-limit", type=float, default=540.0, help="wall seconds of this run, all included")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps of this run (0: no limit)")
    p.add_argument("--budget-s", type=float, default=3000.0,
                   help="training seconds of all runs together (LR decay and stage deadlines follow it)")
    p.add_argument("--decay-frac", type=float, default=0.25)
    p.add_argument("--tokens-per-step", type=int, default=65536, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=100, help="steps (30 after a resume)")
    p.add_argument("--chunk", type=int, default=64, help="Gated DeltaNet chunk length")
    p.add_argument("--workers", type=int, default=None,
                   help="data processes per rank (default: all ranks together use all cores but 4)")
    p.add_argument("--stage", type=int, choices=range(len(STAGES)), help="resume in this curriculum stage")
    p.add_argument("--practice-share", type=float, default=None,
                   help="share of the stage's own (non-replay) prompts drawn from its practice spec "
                        "(its first `extra`; stage 1: lookup-only LOOKUP_SIMPLE, default 0.35)")
    p.add_argument("--replay", type=float, default=None, help="share of prompts replayed from earlier stages")
    p.add_argument("--practice-relations", default="",
                   help="comma list: fact relations of the practice spec, repeats weight them "
                        "(e.g. lives,lives,job,code; default the spec's own: lives,job,code)")
    p.add_argument("--practice-note-tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   metavar="MIN,MAX", help="note lengths of the practice spec (default the spec's own)")
    p.add_argument("--respread", default="",
                   help="comma list of VALUE_CLASSES (cities,jobs): once per checkpoint, give these collapsed "
                        "embedding rows fresh random deviations (train_net.respread_rows)")
    p.add_argument("--cap-mlp", type=float, default=0.0,
                   help="at the start (and every --cap-every steps) scale down the down_proj column of every MLP "
                        "neuron of --cap-layers whose output norm at an answer position exceeds this (0: off; "
                        "run 8's checkpoint: 400; see MlpCap)")
    p.add_argument("--cap-layers", default="7", help="comma list of layers --cap-mlp applies to")
    p.add_argument("--cap-every", type=int, default=0, help="re-apply --cap-mlp every this many steps (0: at the start only)")
    p.add_argument("--eval-per-kind", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25, help="steps between loss-curve points")
    p.add_argument("--tiny", action="store_true", help="a 0.4 M parameter model of the same layout")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, about 30 s (other flags still apply)")
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(tiny=True, time_limit=30.0, budget_s=20.0, tokens_per_step=2048, eval_per_kind=1,
                       workers=1, warmup=5, log_every=5)
        args = p.parse_args()
    if args.workers is None:
        args.workers = max(1, (len(os.sched_getaffinity(0)) - 4) // int(os.environ.get("WORLD_SIZE", "1")))
    return args


def build_model(args: argparse.Namespace, device: torch.device) -> Qwen35ForTraining:
    cfg = json.loads((args.model_dir / "config.json").read_text())
    if args.tiny:
        cfg.update(SMOKE_DIMS, num_hidden_layers=len(SMOKE_DIMS["layer_types"]))
    torch.manual_seed(args.seed)
    return Qwen35ForTraining(cfg, chunk=args.chunk).to(device)


class Ranks:
    """This process's place in a torchrun data-parallel job; rank 0 of 1 without torchrun."""

    def __init__(self) -> None:
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.main = self.rank == 0
        self.control: dist.ProcessGroup | None = None

    def init(self, device: torch.device) -> None:
        """After the data workers are forked: a fork must not copy the process group's threads."""
        if self.world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            # Per-step decisions travel over gloo between CPUs: an NCCL tensor read back each step
            # would make the CPU wait for the GPU and lose the launch overlap.
            self.control = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD

    def decide(self, stop: bool, save: bool, train_s: float) -> tuple[bool, bool, float]:
        """Rank 0's stop and save decisions and training time, the same on every rank."""
        if self.world == 1:
            return stop, save, train_s
        t = torch.tensor([float(stop), float(save), train_s], dtype=torch.float64)
        dist.broadcast(t, 0, group=self.control)
        return bool(t[0]), bool(t[1]), t[2].item()

    def maximum(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.control)
        return int(t.item())

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def replica_diff(self, net: torch.nn.Module) -> float:
        """Largest difference of any weight from rank 0's: zero unless the replicas diverged."""
        flat = torch.cat([p.detach().flatten() for p in net.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        diff = (flat - ref).abs().max()
        dist.all_reduce(diff, dist.ReduceOp.MAX)
        return diff.item()

    def finish(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.control)  # the others wait while rank 0 evaluates and saves
            dist.destroy_process_group()


class Checkpoint:
    """Compact resumable state in one directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def exists(self) -> bool:
        return (self.path / "state.json").exists()

    def save(self, net: Qwen35ForTraining, opt: torch.optim.Optimizer, state: dict, curve: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        names = {p: n for n, p in net.named_parameters()}
        weights = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in net.named_parameters()}
        moments = {names[p]: s["exp_avg_sq"].to(torch.bfloat16).cpu().contiguous()
                   for p, s in opt.state.items() if "exp_avg_sq" in s}
        save_file(weights, str(self.path / "weights.safetensors"), metadata={"format": "pt"})
        save_file(moments, str(self.path / "optimizer.safetensors"))
        (self.path / "state.json").write_text(json.dumps(state, indent=1))
        (self.path / "curve.json").write_text(json.dumps(curve))

    def load(self, net: Qwen35ForTraining, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        device = next(net.parameters()).device
        weights = load_file(str(self.path / "weights.safetensors"))
        net.load_state_dict({n: t.float() for n, t in weights.items()})
        moments, state = load_file(str(self.path / "optimizer.safetensors")), json.loads((self.path / "state.json").read_text())
        for name, p in net.named_parameters():
            if name in moments:
                opt.state[p] = {"step": torch.tensor(float(state["step"])),  # on the CPU: AdamW is not fused
                                "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": moments[name].to(device, torch.float32)}
        return state, json.loads((self.path / "curve.json").read_text())


class Feed:
    """Prefetches batch groups from worker processes; batches of the current stage come first."""

    def __init__(self, args: argparse.Namespace, ranks: Ranks) -> None:
        tokenizer = str(args.model_dir / "tokenizer.json")
        self.args, self.multiple = args, args.chunk
        self.rank, self.world, self.budget = ranks.rank, ranks.world, args.tokens_per_step // ranks.world
        self.pool = multiprocessing.get_context("fork").Pool(args.workers, init_worker, (tokenizer,))
        self.pending: collections.deque = collections.deque()
        self.ready: collections.deque = collections.deque()
        self.stage, self.group, self.stages = 0, 0, STAGES

    def start(self, stage: int, group: int) -> None:
        """From `group` on (the maximum over ranks of `self.group` when saved), rank r builds groups
        group + r, group + r + world, ...: no two ranks, and no two runs, see the same group."""
        self.group = group + self.rank
        self.switch(stage)

    def switch(self, stage: int) -> None:
        """--practice-share / --replay / --practice-relations / --practice-note-tokens apply to whichever
        stage runs (a stage without practice keeps none)."""
        self.stage = stage
        has_practice = bool(STAGES[stage].extra)
        practice = self.args.practice_share if has_practice else None
        relations = tuple(filter(None, self.args.practice_relations.split(","))) if has_practice else None
        note_tokens = self.args.practice_note_tokens if has_practice else None
        self.stages = with_mix(STAGES, stage, practice, self.args.replay, relations or None, note_tokens)
        self.pending.clear()
        self.ready.clear()

    def _submit(self) -> None:
        a = self.args
        self.pending.append(self.pool.apply_async(
            make_group, (self.stage, a.seed, self.group, self.budget, self.multiple, self.stages)))
        self.group += self.world

    def next(self) -> Batch:
        while len(self.pending) < 2 * self.args.workers:
            self._submit()
        if not self.ready:
            self.ready.extend(self.pending.popleft().get())
        return self.ready.popleft()


def respread(args: argparse.Namespace, net: Qwen35ForTraining, tokenizer: Tokenizer, state: dict,
             ranks: Ranks) -> None:
    """--respread: once per checkpoint (state["respread"] lists the classes done), the same on every rank
    (seeded). The new deviations get the size of the company rows' (the class the model does copy)."""
    todo = [c for c in filter(None, args.respread.split(",")) if c not in state.get("respread", [])]
    if not todo:
        return
    weight = net.model.embed_tokens.weight
    norm = deviation_norm(weight, class_token_ids(tokenizer, "companies"))
    generator = torch.Generator().manual_seed(args.seed + 1)
    for name in todo:
        rows = class_token_ids(tokenizer, name)
        before = spread(weight, rows)
        respread_rows(weight, rows, norm, generator)
        if ranks.main:
            print(f"respread {name}: deviation/norm {before:.3f} -> {spread(weight, rows):.3f} "
                  f"(deviation {norm:.3f})", flush=True)
    state["respread"] = state.get("respread", []) + todo


class MlpCap:
    """--cap-mlp: in run 8's checkpoint two last-layer MLP neurons wrote norms of ~2e4 (and ~40 more 400-1e4) at
    the position that predicts a city, a context-free "some city" prior: the final residual there was 5.8e4
    (jobs, linked, two_hop: ~900), so the final RMSNorm divided the attention heads' share of the prediction, and
    the gradient that reaches them, by ~60; the lives loss reached q/k/v/o of the attention layers 100-1000x
    weaker than the job loss and cities were never copied. Capping these neurons (train_net.cap_mlp_neurons)
    restored that gradient to 1/6-1/2 of the jobs' and left every other answer's exact match unchanged (CPU,
    2026-11-29, run 8). Peaks are measured on the answer positions of fixed
    validation prompts (the stage's practice and own spec, earlier stages' specs), the maximum over ranks."""

    def __init__(self, args: argparse.Namespace, tokenizer: Tokenizer, ranks: Ranks) -> None:
        self.cap, self.every, self.ranks = args.cap_mlp, args.cap_every, ranks
        self.layers = {int(x) for x in args.cap_layers.split(",") if x}
        self.tokenizer, self.stage, self.sequences = tokenizer, -1, []

    def __call__(self, net: Qwen35ForTraining, stage: int, state: dict) -> None:
        if not self.cap:
            return
        if stage != self.stage:
            specs = [(s.extra[0][0], 48) for s in STAGES[stage: stage + 1] if s.extra]
            specs += [(STAGES[stage].spec, 48)] + [(STAGES[s].spec, 24) for s in range(stage)]
            self.sequences, self.stage = [], stage
            for spec, n in specs:
                for p in make_prompts(spec, "validation", n):
                    ids, spans = encode(self.tokenizer, p, all_questions=True)
                    self.sequences.append((ids, [i for start, end in spans for i in range(start - 1, end - 1)]))
        training = net.training
        net.eval()
        peaks = mlp_neuron_peaks(net, self.sequences)
        net.train(training)
        for i, peak in enumerate(peaks):
            if self.ranks.world > 1:  # the same columns on every rank
                dist.all_reduce(peak, dist.ReduceOp.MAX, group=self.ranks.control)
            if i not in self.layers:
                peak.zero_()
        capped = cap_mlp_neurons(net, peaks, self.cap)
        state["mlp_capped"] = state.get("mlp_capped", 0) + len(capped)
        if self.ranks.main and capped:
            top = sorted(capped, key=lambda c: -c[2])[:4]
            print(f"cap-mlp {self.cap:g} at step {state['step']}: {len(capped)} neurons, largest "
                  + ", ".join(f"L{layer}/{n} {peak:.0f}" for layer, n, peak in top), flush=True)


def spread(weight: torch.Tensor, rows: list[int]) -> float:
    """Distinctness of a class's embedding rows: mean deviation from their mean over mean row norm
    (~1 at init; the GPU checkpoint of step 19953: cities 0.32, jobs 0.20, companies 0.93)."""
    return deviation_norm(weight, rows) / weight[rows].float().norm(dim=-1).mean().item()


def lr_at(args: argparse.Namespace, train_s: float, run_step: int, resumed: bool) -> float:
    warm = min(1.0, (run_step + 1) / (30 if resumed else args.warmup))
    decay_start = args.budget_s * (1 - args.decay_frac)
    frac = min(1.0, max(0.0, (train_s - decay_start) / max(1e-9, args.budget_s - decay_start)))
    return args.lr * warm * (1.0 - 0.9 * frac)


def to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    fields = ("ids", "positions", "targets", "answer", "kinds", "current", "first", "extra", "rel")
    return {f: torch.from_numpy(getattr(batch, f)).to(device, non_blocking=True).long() for f in fields}


def answer_loss(net: torch.nn.Module, b: dict[str, torch.Tensor],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over supervised tokens, and per-answer correctness (all tokens argmax). In full fp32:
    on the H200 the same model and data bound names to values (EM 1.0 by step 750) in fp32 and never (chance
    after 4.6k steps) under bf16 autocast; the trainer with fp32 weights but tf32 matmuls stayed at chance
    too (3.9k steps; 2026-11-30, docs/training.md)."""
    logits = net(b["ids"], b["positions"])
    loss = F.cross_entropy(logits, b["targets"])
    wrong = torch.zeros(len(b["kinds"]), device=device).index_add_(
        0, b["answer"], (logits.argmax(-1) != b["targets"]).float())
    return loss, wrong == 0


class Meter:
    """Running exact match per kind of the current stage's answers (all turns, and first turns alone:
    later turns see earlier gold answers, which inflates two_hop), and loss, on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.hits = torch.zeros(len(KINDS), device=self.device)
        self.count = torch.zeros(len(KINDS), device=self.device)
        self.hits_first = torch.zeros(len(KINDS), device=self.device)
        self.count_first = torch.zeros(len(KINDS), device=self.device)
        self.hits_practice = torch.zeros(len(RELATIONS), device=self.device)
        self.count_practice = torch.zeros(len(RELATIONS), device=self.device)
        self.loss, self.steps, self.tokens = torch.zeros((), device=self.device), 0, 0

    def add(self, loss: torch.Tensor, correct: torch.Tensor, b: dict[str, torch.Tensor], tokens: int) -> None:
        current = b["current"].float()  # weights, not a mask: masking would wait for the GPU
        self.hits.index_add_(0, b["kinds"], correct.float() * current)
        self.count.index_add_(0, b["kinds"], current)
        first = current * b["first"].float()
        self.hits_first.index_add_(0, b["kinds"], correct.float() * first)
        self.count_first.index_add_(0, b["kinds"], first)
        practice = b["extra"].float() * b["first"].float()  # first turns of practice prompts, per relation
        self.hits_practice.index_add_(0, b["rel"], correct.float() * practice)
        self.count_practice.index_add_(0, b["rel"], practice)
        self.loss += loss.detach()
        self.steps, self.tokens = self.steps + 1, self.tokens + tokens

    def read(self, ranks: Ranks) -> dict:
        """Over all ranks (a collective: every rank reads at the same step); tokens summed."""
        n = len(KINDS)
        r = len(RELATIONS)
        total = ranks.sum(torch.cat([self.hits, self.count, self.hits_first, self.count_first,
                                     self.hits_practice, self.count_practice, self.loss[None] / ranks.world,
                                     torch.tensor([float(self.tokens)], device=self.device)])).tolist()
        hits, count = total[:n], total[n: 2 * n]
        em = {k: round(h / c, 4) for k, h, c in zip(KINDS, hits, count) if c}
        em_first = {k: round(h / c, 4) for k, h, c in zip(KINDS, total[2 * n: 3 * n], total[3 * n: 4 * n]) if c}
        practice = total[4 * n: 4 * n + 2 * r]
        out = {"loss": round(total[4 * n + 2 * r] / max(1, self.steps), 4), "em": em, "em_first": em_first,
               "em_mean": round(sum(hits) / max(1.0, sum(count)), 4), "tokens": total[4 * n + 2 * r + 1]}
        if sum(practice[r:]):  # first-turn EM of the practice prompts per relation (not in the gate)
            out["em_practice"] = {k: round(h / c, 4) for k, h, c in zip(RELATIONS, practice[:r], practice[r:]) if c}
        return out


@torch.no_grad()
def evaluate(net, prompts, tokenizer, device: torch.device, token_budget: int,
             by_relation: bool = False) -> dict[str, float]:
    """Teacher-forced exact match of the first answer, per question kind (or per lookup relation)."""
    net.eval()
    labels = RELATIONS if by_relation else KINDS
    rows = sorted((encode(tokenizer, p, all_questions=False) + (
        [relation_index(p.kind, p.qas[0].question) if by_relation else KINDS.index(p.kind)], True) for p in prompts),
        key=lambda r: len(r[0]))
    hits, count = collections.Counter(), collections.Counter()
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and (end + 1 - start) * len(rows[end][0]) <= token_budget:
            end += 1
        b = to_device(collate(rows[start:end], 64), device)
        _, correct = answer_loss(net, b, device)
        for kind, ok in zip(b["kinds"].tolist(), correct.tolist()):
            hits[labels[kind]] += ok
            count[labels[kind]] += 1
        start = end
    net.train()
    return {k: round(hits[k] / count[k], 4) for k in labels if count[k]}


def run_evals(net, args, tokenizer, device, stage: int) -> dict:
    n = args.eval_per_kind
    spec, budget = STAGES[stage].spec, max(args.tokens_per_step, 8192)
    out = {"eval_spec": evaluate(net, eval_prompts(n, "validation", EVAL_SPEC), tokenizer, device, budget),
           f"stage{stage}": evaluate(net, make_prompts(spec, "validation", 4 * n), tokenizer, device, budget)}
    if STAGES[stage].extra:  # the practice spec, per relation (what diagnose_model.py --extra splits)
        out["practice"] = evaluate(net, make_prompts(STAGES[stage].extra[0][0], "validation", 4 * n), tokenizer,
                                   device, budget, by_relation=True)
    return out


def main() -> None:
    args, started, ranks = parse_args(), STARTED, Ranks()
    feed = Feed(args, ranks)  # fork before CUDA or the process group is touched
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device(f"cuda:{ranks.local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the data workers take the other cores; oversubscribed OpenMP crawls
    ranks.init(device)  # matmuls stay fp32, not tf32: see answer_loss
    net = build_model(args, device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)  # as the probes
    ckpt = Checkpoint(args.ckpt)
    resumed = ckpt.exists()
    state, curve = ckpt.load(net, opt) if resumed else (fresh_state(), fresh_curve())
    if args.stage is not None:
        state["stage"], state["stage_step"] = args.stage, 0
    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    respread(args, net, tokenizer, state, ranks)
    cap = MlpCap(args, tokenizer, ranks)
    cap(net, state["stage"], state)
    feed.start(state["stage"], state["group"])
    params = sum(p.numel() for p in net.parameters())
    if ranks.main:
        print(f"device {device} x{ranks.world} workers {args.workers} params {params / 1e6:.2f}M "
              f"resumed={resumed} state={state}", flush=True)
    model = net if ranks.world == 1 else DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    classes = {name: class_token_ids(tokenizer, name) for name in ("cities", "jobs", "companies")}
    train(args, model, opt, feed, device, state, curve, resumed, started, ckpt, ranks, classes, cap)
    if ranks.world > 1:
        diff = ranks.replica_diff(net)
        if ranks.main:
            print(f"replicas: max |weight - rank 0's| = {diff:g}", flush=True)
    if ranks.main:
        curve["evals"].append({"step": state["step"], "stage": state["stage"],
                               **run_evals(net, args, tokenizer, device, state["stage"])})
        print(json.dumps(curve["evals"][-1]), flush=True)
        state["runs"] += 1
        ckpt.save(net, opt, state, curve)
        print(f"saved {args.ckpt} after {time.monotonic() - started:.0f}s", flush=True)
    feed.pool.terminate()
    ranks.finish()


def fresh_state(step: int = 0) -> dict:
    """state.json of a checkpoint that has trained `step` steps and nothing else: stage 0, fresh schedule."""
    return {"step": step, "stage": 0, "train_s": 0.0, "group": 0, "stage_step": step, "runs": 0}


def fresh_curve() -> dict:
    """curve.json of a checkpoint with no loss points or evaluations yet."""
    return {"points": [], "evals": []}


def run_over(args: argparse.Namespace, run_step: int, elapsed_s: float) -> bool:
    """This run has spent its time (less the reserve for the final evaluation and save) or its --max-steps."""
    reserve = 8.0 if args.smoke else 45.0
    return elapsed_s >= args.time_limit - reserve or 0 < args.max_steps <= run_step


def train(args, model: torch.nn.Module, opt, feed: Feed, device, state: dict, curve: dict, resumed: bool,
          started: float, ckpt: Checkpoint, ranks: Ranks, classes: dict[str, list[int]],
          cap: MlpCap | None = None) -> None:
    """`model` is the DDP wrapper under torchrun: its backward averages the gradients over ranks."""
    net = model.module if isinstance(model, DistributedDataParallel) else model
    meter, gate_meter = Meter(device), Meter(device)
    run_step, last_log, last_save = 0, time.monotonic(), time.monotonic()
    while True:
        now = time.monotonic()
        stop, save, state["train_s"] = ranks.decide(
            run_over(args, run_step, now - started), now - last_save > 150, state["train_s"])
        if save:
            state["group"] = ranks.maximum(feed.group)
            if ranks.main:
                ckpt.save(net, opt, state, curve)
            last_save = time.monotonic()
        if stop:
            break
        t0 = time.monotonic()
        batch = feed.next()
        b = to_device(batch, device)
        for group in opt.param_groups:
            group["lr"] = lr_at(args, state["train_s"], run_step, resumed)
        loss, correct = answer_loss(model, b, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.add(loss, correct, b, batch.tokens)
        gate_meter.add(loss, correct, b, batch.tokens)
        state["step"], state["stage_step"], run_step = state["step"] + 1, state["stage_step"] + 1, run_step + 1
        if cap is not None and cap.every and run_step % cap.every == 0:
            cap(net, state["stage"], state)
        if state["step"] % args.log_every == 0:
            log_point(meter, state, curve, opt, last_log, ranks, classes, net.model.embed_tokens.weight)
            meter.reset()
            last_log = time.monotonic()
            maybe_advance(args, gate_meter, state, feed, ranks)
        state["train_s"] += time.monotonic() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    state["group"] = ranks.maximum(feed.group)


def log_point(meter: Meter, state: dict, curve: dict, opt, since: float, ranks: Ranks,
              classes: dict[str, list[int]], weight: torch.Tensor) -> None:
    """Every rank's counts, summed; rank 0 prints them (the others' curves are never saved)."""
    point = {"step": state["step"], "stage": state["stage"], "train_s": round(state["train_s"], 1),
             "lr": opt.param_groups[0]["lr"], **meter.read(ranks),
             "spread": {name: round(spread(weight.detach(), rows), 3) for name, rows in classes.items()}}
    point["tok_per_s"] = round(point.pop("tokens") / max(1e-9, time.monotonic() - since))
    curve["points"].append(point)
    if ranks.main:
        print(json.dumps(point), flush=True)


def maybe_advance(args, gate_meter: Meter, state: dict, feed: Feed, ranks: Ranks) -> None:
    """Every >= 100 steps: next stage once the stage's first-turn answers pass its gate on every kind
    seen, or once the stage's share of the time budget is spent, but a deadline forces the stage only
    after `min_steps` steps in it and once each kind in `needs` reaches `floor` (first turns)."""
    stage = STAGES[state["stage"]]
    if gate_meter.steps < 100:
        return
    em = gate_meter.read(ranks)["em_first"]
    passed = bool(em) and min(em.values()) >= stage.gate
    short = {k: em.get(k, 0.0) for k in stage.needs if em.get(k, 0.0) < stage.floor}
    late = state["train_s"] >= stage.until * args.budget_s
    forced = late and state["stage_step"] >= stage.min_steps and not short
    if state["stage"] + 1 < len(STAGES) and (passed or forced):
        state["stage"], state["stage_step"] = state["stage"] + 1, 0
        feed.switch(state["stage"])
        if ranks.main:
            print(f"stage -> {state['stage']} at step {state['step']} ({'gate' if passed else 'deadline'}, "
                  f"first-turn em {em})", flush=True)
    elif late and state["stage"] + 1 < len(STAGES) and ranks.main:
        print(f"stage {state['stage']} past its deadline, staying: step {state['stage_step']} of at least "
              f"{stage.min_steps}, below floor {stage.floor}: {short}", flush=True)
    gate_meter.reset()


if __name__ == "__main__":
    main()
