"""One completion being generated, and the request that groups its n completions."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hypic.cache import prefix_cache
from hypic.engine.pic.pieces import Chunk, cut_chunk
from hypic.engine.pic.segments import SegmentedPrompt
from hypic.engine.pic.state import PicState
from hypic.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestInfo:
    """What every completion of one request shares."""

    request_id: str
    params: SamplingParams
    prompt: SegmentedPrompt
    cache_salt: str | None
    cache_mode: str
    seam_width: int = 8
    group: str | None = None  # the requests of one client call (a batch's prompts) share it; None: its own
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    cached_tokens_by_kind: dict[str, int] = field(default_factory=dict)  # "prefix", "pic", "pic_host", "pic_disk"

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.prompt.token_ids

    @property
    def admission_group(self) -> str:
        """What the scheduler admits in turn with others: the group, else the request itself."""
        return self.group or self.request_id

    @property
    def segment_ends(self) -> tuple[int, ...]:
        """Token offsets where each prompt segment ends."""
        return self.prompt.boundaries[1:]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a cache; at least the last one is always computed."""
        return min(sum(self.cached_tokens_by_kind.values()), len(self.prompt_ids) - 1)


class Sequence:
    """Tokens (prompt + output so far) and where their cache lives.

    Invariant: the first `num_computed` tokens are in the KV pages and in the state slot.
    """

    def __init__(self, info: RequestInfo, index: int, output_ids: list[int] | None = None) -> None:
        self.info, self.index = info, index
        self.output_ids: list[int] = list(output_ids or [])
        self.token_ids: list[int] = [*info.prompt_ids, *self.output_ids]
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.slot: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.checkpoints: list[int] = []  # prefix lengths whose state is kept once computed
        self.pic = PicState()  # owned by the PIC assembler
        self.admission_turn = 0  # its round in fair admission (Scheduler.add); 0: ahead of every round

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.remaining == 1 and self.num_computed > 0

    def provenance(self, length: int) -> str:
        """How the state after `length` tokens was computed (prefix-cache checkpoints carry it)."""
        start = self.pic.approximate_from
        if start is None or length <= start:
            return "exact"
        mode = self.info.cache_mode
        return "naive" if mode == "naive" else f"hypic:{self.info.seam_width}"

    def token_bytes(self, length: int) -> bytes:
        """The first `length` token ids as `token_bytes` (prefix-cache keys): the prompt's part is
        sliced from the bytes its request converted once, only output ids are converted here."""
        prompt = self.info.prompt.token_bytes
        extra = length - len(self.info.prompt_ids)
        if extra <= 0:
            return prompt[:prefix_cache.TOKEN_SIZE * length]
        return prompt + prefix_cache.token_bytes(self.output_ids[:extra])

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def next_chunk(self, budget: int, *, through_checkpoints: bool = False) -> Chunk:
        """The next chunk of at most `budget` tokens, cut at the next checkpoint position (unless
        the step keeps that state some other way)."""
        limit = min([len(self.token_ids)] + [c for c in self.checkpoints
                                             if c > self.num_computed and not through_checkpoints])
        return cut_chunk(self.token_ids, self.num_computed, limit, budget, self.pic.cached)

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """After preemption: everything is recomputed later (possibly from a prefix checkpoint)."""
        self.num_computed, self.block_ids, self.slot = 0, [], None
        self.status = SequenceStatus.WAITING
        self.pic.captured, self.pic.captured_kv = None, []  # a cold job's partial tuple: recomputed too
