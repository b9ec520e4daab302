"""hypic's IncrementalDetokenizer against `tokenizers`' DecodeStream: same text? how fast?

Both stream the tokenizer tests' corpus (tests/tokenizer_util.py: a byte-level BPE and a metaspace
BPE with byte fallback) one token at a time. The reference is what the output adds to the full
decode: decode(context + output) minus decode(context), context being the prompt's last 5 ids.
"valid" outputs encode random text of the tests' alphabet; "random" outputs are random ids (what a
broken model emits). DecodeStream has no flush, so an incomplete last character is lost there;
when it raises, the case counts as different. Prints a table and writes JSON:

    PYTHONPATH=. python scripts/bench_detokenizer.py
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from results import result_path, run_record
from tokenizers.decoders import DecodeStream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tokenizer_util import CORPUS, write_byte_level, write_metaspace  # noqa: E402

from hypic.engine.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from hypic.engine.text.tokenizer import Tokenizer  # noqa: E402

ALPHABET = "ab é世界🙂👍🏽ü\n.Ωж日本"
Case = tuple[list[int], list[int], bool]  # prompt ids, output ids, skip_special_tokens


def hypic_text(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    return "".join(detok.push([t]) for t in output) + detok.flush()


def stream_text(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str | None:
    """DecodeStream's chunks, or None when it raises (invalid bytes under a byte-fallback decoder)."""
    context = [i for i in prompt[-5:] if not (skip and i in tokenizer.special_ids)]
    stream = DecodeStream(ids=context, skip_special_tokens=skip)
    try:
        return "".join(chunk for t in output if (chunk := stream.step(tokenizer._backend, t)) is not None)
    except Exception:  # tokenizers raises a bare Exception ("Invalid prefix encountered ...")
        return None


def reference(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    context = prompt[-5:]
    full = tokenizer.decode(context + output, skip_special_tokens=skip)
    return full[len(tokenizer.decode(context, skip_special_tokens=skip)):]


def cases(tokenizer: Tokenizer, kind: str, count: int, rng: random.Random) -> list[Case]:
    if kind == "valid":
        return [(tokenizer.encode(rng.choice(CORPUS)[:rng.randint(0, 30)], add_special_tokens=True),
                 tokenizer.encode("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))), True)
                for _ in range(count)]
    return [([rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 8))],
             [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))], rng.random() < 0.5)
            for _ in range(count)]


def agreement(tokenizer: Tokenizer, kind: str, count: int) -> dict[str, int]:
    found = cases(tokenizer, kind, count, random.Random(0))
    texts = [(reference(tokenizer, *c), hypic_text(tokenizer, *c), stream_text(tokenizer, *c)) for c in found]
    return {"cases": count, "hypic_same": sum(r == h for r, h, _ in texts),
            "decode_stream_same": sum(r == s for r, _, s in texts),
            "decode_stream_raised": sum(s is None for _, _, s in texts)}


def microseconds_per_token(tokenizer: Tokenizer, decode: Callable[..., str | None], output: list[int]) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        decode(tokenizer, [], output, True)
        best = min(best, time.perf_counter() - start)
    return best / len(output) * 1e6


def measure(name: str, tokenizer: Tokenizer, count: int) -> dict[str, object]:
    long_output = tokenizer.encode(" ".join(CORPUS) * 50)
    return {"tokenizer": name, **{kind: agreement(tokenizer, kind, count) for kind in ("valid", "random")},
            "hypic_us_per_token": microseconds_per_token(tokenizer, hypic_text, long_output),
            "decode_stream_us_per_token": microseconds_per_token(tokenizer, stream_text, long_output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--out", type=Path, default=result_path("detokenizer", "cpu", "corpus"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    rows = [measure(name, Tokenizer.from_dir(write(root / name)), args.cases)
            for name, write in (("byte_level", write_byte_level), ("metaspace", write_metaspace))]
    for row in rows:
        print(f"{row['tokenizer']:10}", *(f"{kind}: hypic {row[kind]['hypic_same']}/{row[kind]['cases']}, "
              f"DecodeStream {row[kind]['decode_stream_same']} ({row[kind]['decode_stream_raised']} raised)"
              for kind in ("valid", "random")),
              f"us/token: hypic {row['hypic_us_per_token']:.2f}, DecodeStream {row['decode_stream_us_per_token']:.2f}",
              sep="  ")
    result = {**run_record(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
